"""The suite's one fake llama-server: scripted, on real loopback sockets.

Each request is answered by a *script* chosen by its path (``fake.route(path,
script)``; a route may also be a function of the request that returns the script),
failing that by the ``X-Fake-Script`` request header (a JSON list, for ad-hoc use
from other processes), failing that by ``fake.fallback`` (a function of the request)
or an echo.  A script is a list of steps:

``("head", status, headers)``  send the response head (h11 picks the framing)
``("send", bytes)``            send a body chunk (SSE text, notices, ...)
``("sleep", seconds)``         pause (a park, a stall, prompt processing)
``("end",)``                   finish the response cleanly
``("die",)``                   close the socket abruptly (upstream crash)
``("hang",)``                  wait until the client goes away
``("echo",)``                  200 with the request body echoed back
``("raw", bytes)``             write bytes as they are: a lying upstream's framing, 1xx
                               floods, a head dripped line by line
``("keep",)``                  after raw steps: serve the next request on this connection
                               anyway (the lie is complete; a proxy that pooled the
                               connection gets whatever the raw bytes left behind)
``("call", fn)``               call ``fn()`` at this point (a counter that must change
                               exactly when a notice is sent)

Helpers build llama-server-like streams: :func:`sse_head`, :func:`chunk`,
:func:`park_script`.  Every connection is recorded (:class:`ConnRecord`):
accept time, requests seen with their headers and body, and ``closed_at``: the
monotonic time the peer closed the connection, measured by a reader that
watches the socket while the script runs, so tests can check how fast the
sidecar drops an upstream connection.

The server runs inside the caller's event loop (``async with FakeUpstream()``)
or in its own thread (:func:`fake_upstream_in_thread`) for benchmarks and for
tests that drive the sidecar from another process.

As a program, ``python -m tests.support.fake_upstream`` stands in for the llama-server
*binary* (:class:`LlamaServerFake`): it takes llama-server's command line (``-m FILE
--host H --port P ...``; the rest is ignored), answers ``/health``, ``/metrics`` (a few
``llamacpp:`` families) and streams chat completions as llama-server does, with one
``: preempted`` / ``: preempt-keepalive`` / ``: resumed`` park in the middle of each stream
when ``FAKE_PARK_S`` is set (keepalives every ``FAKE_PARK_KEEPALIVE_S``, default 0.5;
``0`` = a silent park). ``--help`` lists ``--preempt-ram`` unless ``FAKE_NO_PREEMPT=1``,
so ``up``'s feature probe can be exercised both ways; ``--fake-fail`` makes it exit at
once like a bad argument would. :func:`fake_server_bin` writes an executable that runs it,
for ``up --server-bin``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import h11
from anyio.from_thread import start_blocking_portal

if TYPE_CHECKING:
    from tests.support.memnet import MemoryNet

Step = tuple[Any, ...]
Script = list[Step]
Handler = Callable[["RequestRecord"], Script]

SSE_HEADERS = [(b"Content-Type", b"text/event-stream"), (b"Cache-Control", b"no-cache")]


def sse_head(status: int = 200) -> Step:
    return ("head", status, SSE_HEADERS)


def chunk(i: int, text: str = "tok") -> bytes:
    """One llama-server-like streaming chunk event."""
    payload = {
        "choices": [{"index": 0, "delta": {"content": f"{text}{i}"}}],
        "object": "chat.completion.chunk",
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def json_response(status: int, doc: Any, ctype: bytes = b"application/json") -> Script:
    """A whole JSON (or other) response with a Content-Length."""
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    headers = [(b"Content-Type", ctype), (b"Content-Length", str(len(body)).encode())]
    return [("head", status, headers), ("send", body), ("end",)]


def park_script(
    before: int = 3, park: float = 6.0, after: int = 3, *, upstream_keepalive: float | None = None
) -> Script:
    """Stream, park for ``park`` seconds (optionally with upstream keepalives), resume."""
    s: Script = [sse_head()]
    s += [("send", chunk(i)) for i in range(before)]
    s.append(("send", b": preempted\n\n"))
    if upstream_keepalive:
        t = 0.0
        while t + upstream_keepalive < park:
            s += [("sleep", upstream_keepalive), ("send", b": preempt-keepalive\n\n")]
            t += upstream_keepalive
        s.append(("sleep", park - t))
    else:
        s.append(("sleep", park))
    s.append(("send", b": resumed\n\n"))
    s += [("send", chunk(i)) for i in range(before, before + after)]
    s += [("send", b"data: [DONE]\n\n"), ("end",)]
    return s


@dataclass
class RequestRecord:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    received_at: float = 0.0


@dataclass
class ConnRecord:
    accepted_at: float
    requests: list[RequestRecord] = field(default_factory=list)
    closed_at: float | None = None  # peer closed (EOF seen while serving or idle)
    closed: anyio.Event = field(default_factory=anyio.Event)

    def peer_closed(self) -> None:
        """Note the first moment the peer was seen gone."""
        if self.closed_at is None:
            self.closed_at = time.monotonic()
            self.closed.set()


async def _receive(stream: anyio.abc.ByteStream) -> bytes:
    """The next bytes from the peer; b"" once it closed or the connection broke."""
    try:
        return await stream.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
            ConnectionError):  # fmt: skip
        return b""


class FakeUpstream:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, net: MemoryNet | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.net = net  # listen there (in memory) rather than on a socket
        self.routes: dict[bytes, Script | Handler] = {}
        self.fallback: Handler | None = None
        self.conns: list[ConnRecord] = []
        self.request_seen = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def route(self, path: str, script: Script | Handler) -> str:
        self.routes[path.encode()] = script
        return path

    @property
    def requests(self) -> list[RequestRecord]:
        return [r for c in self.conns for r in c.requests]

    async def __aenter__(self) -> FakeUpstream:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self.net is not None:
            self._listener = None
            self.host, self.port = self.net.listen("upstream.test", self._handle)
            return self
        self._listener = await anyio.create_tcp_listener(
            local_host=self.host, local_port=self.port, backlog=4096
        )
        self.port = self._listener.extra(anyio.abc.SocketAttribute.local_port)
        self._tg.start_soon(self._listener.serve, self._handle)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            if self._listener is not None:
                with anyio.CancelScope(shield=True):
                    await self._listener.aclose()

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        rec = ConnRecord(time.monotonic())
        self.conns.append(rec)
        conn = h11.Connection(h11.SERVER)
        buf = _Reader(stream, conn, rec)
        try:
            while True:
                req = await buf.next_request()
                if req is None:
                    return
                rec.requests.append(req)
                self.request_seen.set()
                self.request_seen = anyio.Event()
                script = self._script_for(req)
                alive = await self._run(script, req, stream, conn, rec)
                if alive and script and script[-1][0] == "keep":
                    leftover = bytes(conn.trailing_data[0])
                    conn = buf.conn = h11.Connection(h11.SERVER)
                    if leftover:  # (b"" would tell h11 the peer closed)
                        conn.receive_data(leftover)
                    continue
                if not alive or conn.our_state is h11.MUST_CLOSE:
                    return
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
                else:
                    return
        except (
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
            ConnectionError,
            h11.ProtocolError,
        ):
            rec.peer_closed()
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    def _script_for(self, req: RequestRecord) -> Script:
        route = self.routes.get(req.target.split(b"?")[0])
        if route is not None:
            return route(req) if callable(route) else route
        raw = dict(req.headers).get(b"x-fake-script")
        if raw:
            return _decode_script(raw)
        return self.fallback(req) if self.fallback is not None else [("echo",)]

    async def _run(
        self,
        script: Script,
        req: RequestRecord,
        stream: anyio.abc.ByteStream,
        conn: h11.Connection,
        rec: ConnRecord,
    ) -> bool:
        """Run the script while a watcher notes when the peer closes; False if closed."""
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while True:
                    data = await _receive(stream)
                    if not data:
                        rec.peer_closed()
                        tg.cancel_scope.cancel()
                        return
                    conn.receive_data(data)  # pipelined bytes for the next cycle

            tg.start_soon(watch)
            died = False
            try:
                died = await self._steps(script, req, stream, conn)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                rec.peer_closed()
            tg.cancel_scope.cancel()
        return rec.closed_at is None and not died

    async def _steps(
        self,
        script: Script,
        req: RequestRecord,
        stream: anyio.abc.ByteStream,
        conn: h11.Connection,
    ) -> bool:
        """Run the steps; True if the script killed the connection ("die")."""
        for step in script:
            op = step[0]
            if op == "head":
                await stream.send(conn.send(h11.Response(status_code=step[1], headers=step[2])))
            elif op == "send":
                await stream.send(conn.send(h11.Data(data=step[1])))
            elif op == "raw":
                await stream.send(step[1])
            elif op == "sleep":
                await anyio.sleep(step[1])
            elif op == "end":
                await stream.send(conn.send(h11.EndOfMessage()))
            elif op == "die":
                await stream.aclose()
                return True
            elif op == "hang":
                await anyio.sleep_forever()
            elif op == "keep":
                pass  # see _handle
            elif op == "call":
                step[1]()
            elif op == "echo":
                ctype = dict(req.headers).get(b"content-type", b"application/octet-stream")
                headers = [
                    (b"Content-Type", ctype),
                    (b"Content-Length", str(len(req.body)).encode()),
                ]
                await stream.send(conn.send(h11.Response(status_code=200, headers=headers)))
                if req.method != b"HEAD":
                    await stream.send(conn.send(h11.Data(data=req.body)))
                await stream.send(conn.send(h11.EndOfMessage()))
            else:  # pragma: no cover
                raise ValueError(f"unknown step {op!r}")
        return False


class _Reader:
    def __init__(self, stream: anyio.abc.ByteStream, conn: h11.Connection, rec: ConnRecord) -> None:
        self.stream = stream
        self.conn = conn
        self.rec = rec

    async def _event(self) -> h11.Event | None:
        while True:
            ev = self.conn.next_event()
            if ev is h11.NEED_DATA:
                data = await _receive(self.stream)
                if not data:
                    self.rec.peer_closed()
                self.conn.receive_data(data)
                continue
            assert isinstance(ev, h11.Event)
            return ev

    async def next_request(self) -> RequestRecord | None:
        ev = await self._event()
        if not isinstance(ev, h11.Request):
            return None
        req = RequestRecord(
            ev.method, ev.target, list(ev.headers.raw_items()), received_at=time.monotonic()
        )
        body = bytearray()
        while True:
            ev = await self._event()
            if isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                return None
        req.body = bytes(body)
        return req


def _decode_script(raw: bytes) -> Script:
    steps = json.loads(raw)
    out: Script = []
    for step in steps:
        if step[0] == "head":
            out.append(("head", step[1], [(k.encode(), v.encode()) for k, v in step[2]]))
        elif step[0] == "send":
            out.append(("send", step[1].encode()))
        else:
            out.append(tuple(step))
    return out


def encode_script(script: Script) -> str:
    """JSON for the ``X-Fake-Script`` header (bytes as text)."""
    out: list[Any] = []
    for step in script:
        if step[0] == "head":
            out.append(["head", step[1], [[k.decode(), v.decode()] for k, v in step[2]]])
        elif step[0] == "send":
            out.append(["send", step[1].decode()])
        else:
            out.append(list(step))
    return json.dumps(out)


async def _serve_fake(
    *, task_status: anyio.abc.TaskStatus[FakeUpstream] = anyio.TASK_STATUS_IGNORED
) -> None:
    async with FakeUpstream() as fake:
        task_status.started(fake)
        await anyio.sleep_forever()


@contextmanager
def fake_upstream_in_thread() -> Iterator[FakeUpstream]:
    """A FakeUpstream served by its own event loop in a background thread.

    Routes may be added from the calling thread before requests arrive.
    """
    with start_blocking_portal("asyncio") as portal:
        future, fake = portal.start_task(_serve_fake)
        try:
            yield fake
        finally:
            future.cancel()


@asynccontextmanager
async def fake_upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


# ------------------------------------------------------------------ llama-server stand-in


TOKEN_EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "tok "}}]}\n\n'


@dataclass
class LlamaServerFake:
    """llama-server's endpoints, as far as `up`, the sidecar and the dashboards use them.

    ``park_s`` > 0: each stream parks once, half-way, for that long, with a
    ``: preempt-keepalive`` every ``park_keepalive_s`` (0: a silent park).
    """

    park_s: float = 0.0
    park_keepalive_s: float = 0.5
    token_interval: float = 0.005
    parks: int = 0
    resumes: int = 0
    parked: int = 0
    tokens: int = 0

    def install(self, fake: FakeUpstream) -> FakeUpstream:
        fake.fallback = self.answer
        return fake

    def answer(self, req: RequestRecord) -> Script:
        if req.method == b"GET" and req.target == b"/health":
            return json_response(200, {"status": "ok"})
        if req.method == b"GET" and req.target == b"/metrics":
            return json_response(200, self.metrics_text().encode(), b"text/plain; version=0.0.4")
        if req.method != b"POST":
            return json_response(404, {"error": {"code": 404, "message": "File Not Found"}})
        body = json.loads(req.body or b"{}")
        n = int(body.get("max_tokens") or body.get("n_predict") or 8)
        if not body.get("stream"):
            msg = {"choices": [{"message": {"role": "assistant", "content": "x" * n}}]}
            return json_response(200, msg)
        return self.stream_script(n)

    def metrics_text(self) -> str:
        families = [
            ("n_preempt_total", "counter", self.parks),
            ("n_resume_total", "counter", self.resumes),
            ("requests_preempted", "gauge", self.parked),
            ("preempt_recompute_total", "counter", 0),
            ("preempt_dropped_total", "counter", 0),
            ("preempt_ram_bytes", "gauge", self.parked * 1048576),
            ("n_decode_total", "counter", self.tokens),
            ("tokens_predicted_total", "counter", self.tokens),
        ]
        return "".join(f"# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
                       for name, kind, value in families)  # fmt: skip

    def stream_script(self, n: int) -> Script:
        s: Script = [("head", 200, [(b"Content-Type", b"text/event-stream")])]
        for i in range(n):
            if self.park_s and i == n // 2:
                s += self._park()
            s += [("call", self._count_token), ("send", TOKEN_EVENT),
                   ("sleep", self.token_interval)]  # fmt: skip
        return [*s, ("send", b"data: [DONE]\n\n"), ("end",)]

    def _park(self) -> Script:
        s: Script = [("call", self._park_starts), ("send", b": preempted\n\n")]
        if not self.park_keepalive_s:
            s.append(("sleep", self.park_s))
        else:
            left = self.park_s
            while left > 0:
                s += [("sleep", min(self.park_keepalive_s, left)),
                      ("send", b": preempt-keepalive\n\n")]  # fmt: skip
                left -= self.park_keepalive_s
        return [*s, ("call", self._park_ends), ("send", b": resumed\n\n")]

    def _count_token(self) -> None:
        self.tokens += 1

    def _park_starts(self) -> None:
        self.parks += 1
        self.parked += 1

    def _park_ends(self) -> None:
        self.parked -= 1
        self.resumes += 1


HELP = "usage: fake llama-server\n  -m, --model FNAME\n  --port PORT\n"
HELP_PREEMPT = "  --preempt-ram N    MiB of host RAM for parked states\n"


def main(argv: list[str]) -> int:
    """Be llama-server for `up`: its --help, its argument errors, its endpoints."""
    if "--help" in argv:
        print(HELP + ("" if os.environ.get("FAKE_NO_PREEMPT") == "1" else HELP_PREEMPT), end="")
        return 0
    if "--fake-fail" in argv:  # an argument llama-server would reject
        print("error: invalid argument: --fake-fail", flush=True)
        return 1
    host, port = "127.0.0.1", 8080
    for i, a in enumerate(argv):
        if a == "--host":
            host = argv[i + 1]
        elif a == "--port":
            port = int(argv[i + 1])
    llama = LlamaServerFake(float(os.environ.get("FAKE_PARK_S") or 0),
                            float(os.environ.get("FAKE_PARK_KEEPALIVE_S", "0.5")))  # fmt: skip
    print("fake llama-server argv: " + json.dumps(argv), flush=True)

    async def serve() -> None:
        async with FakeUpstream(host, port) as fake:
            llama.install(fake)
            await anyio.sleep_forever()

    anyio.run(serve)
    return 0


def fake_server_bin(directory: Path) -> Path:
    """An executable ``llama-server`` in ``directory`` that runs this module's :func:`main`.

    It answers ``--help`` (which `up` asks on every start) itself, without starting Python.
    """
    repo = Path(__file__).resolve().parents[2]
    path = directory / "llama-server"
    path.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do\n'
        '  if [ "$a" = --help ]; then\n'
        f"    printf %s {shlex.quote(HELP)}\n"
        f'    [ "$FAKE_NO_PREEMPT" = 1 ] || printf %s {shlex.quote(HELP_PREEMPT)}\n'
        "    exit 0\n"
        "  fi\n"
        "done\n"
        f'export PYTHONPATH={shlex.quote(str(repo))}"${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f'exec {shlex.quote(sys.executable)} -m tests.support.fake_upstream "$@"\n'
    )
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

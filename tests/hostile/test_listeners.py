"""Finding 1: a connection-level failure on either listener ends that connection only.

The metrics listener used to wait 30 s for a request with ``move_on_after`` and then read
the variable it never set (``UnboundLocalError``, which cut every stream and ended the
process) or, after a first request, loop on ``ConnectionClosed`` without yielding (the
process froze and ignored SIGTERM).  Now both listeners share one connection loop with
the configured idle and head timeouts, and a bug in one connection is logged and ends
only that connection.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
from anyio.abc import SocketAttribute

from sidecar.config import config_argv
from sidecar.proxy.h11stream import H11Stream
from sidecar.proxy.server import Sidecar
from tests.support.fake_upstream import FakeUpstream, chunk, fake_upstream_in_thread, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.procs import ManagedProcess
from tests.support.rawclient import RawConn
from tests.support.sidecar import READY_RE, ephemeral_config, start_subprocess

GET_HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: m\r\n\r\n"
GET_METRICS = b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n"


def _metrics_base(sc: Sidecar) -> str:
    assert sc.metrics_url is not None
    return sc.metrics_url.removesuffix("/metrics")


async def ticks_until_closed(conn: RawConn, every: float = 0.1) -> tuple[bytes, int]:
    """Wait for the server to close ``conn``: what came before, and how many ``every``-second
    sleeps ended meanwhile.

    The sleeps run on the loop the server's timers run on (in memory): a loop held up by
    the machine's load delays both, so the count bounds a timeout where seconds would not.
    """
    ticks = 0
    async with anyio.create_task_group() as tg:

        async def tick() -> None:
            nonlocal ticks
            while True:
                await anyio.sleep(every)
                ticks += 1

        tg.start_soon(tick)
        rest = await conn.wait_closed(timeout=10)
        tg.cancel_scope.cancel()
    return rest, ticks


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_idle_keepalive_scrape_connection_is_closed_after_keepalive_timeout(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    async with sidecar_factory(fake.url, keepalive_timeout=0.5, header_timeout=0.5) as sc:
        base = _metrics_base(sc)
        async with await RawConn.open(base) as conn:
            for request in (GET_METRICS, GET_HEALTHZ):  # keep-alive: two on one connection
                await conn.send(request)
                resp = await conn.read_response()
                assert resp.status == 200
                assert resp.reason == b"OK"
            t0 = time.monotonic()
            rest, ticks = await ticks_until_closed(conn)
            assert rest == b""
            assert time.monotonic() - t0 > 0.4
            assert ticks <= 0.5 / 0.1 + 2  # the keep-alive timeout, not a later one
        async with await RawConn.open(base) as silent:
            rest, ticks = await ticks_until_closed(silent)
            assert rest == b""  # no byte: closed quietly
            assert ticks <= 0.5 / 0.1 + 2
        async with await RawConn.open(base) as conn:  # the listener still serves
            await conn.send(GET_HEALTHZ)
            assert (await conn.read_response()).body == b"ok\n"


async def drip_until_answered(
    conn: RawConn, head: bytes, line: bytes, every: float
) -> tuple[float, int]:
    """Send ``head``, then ``line`` every ``every`` s until the server answers.

    Returns how long that took and how many lines were sent.  The lines are counted on the
    clock the server's deadline runs on (the same event loop, in memory), so their number
    bounds the deadline whatever the machine's load: a stalled loop delays the drip as
    much as the deadline.
    """
    t0 = time.monotonic()
    sent = 0
    await conn.send(head)
    async with anyio.create_task_group() as tg:

        async def drip() -> None:
            nonlocal sent
            while True:
                await anyio.sleep(every)
                await conn.send(line)
                sent += 1

        tg.start_soon(drip)
        status_line = await conn.read_until(b"\r\n", timeout=10)
        conn.buf = status_line + conn.buf  # left for read_response
        tg.cancel_scope.cancel()
    return time.monotonic() - t0, sent


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_metrics_listener_slowloris_gets_408(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    async with (
        sidecar_factory(fake.url, header_timeout=0.5) as sc,
        await RawConn.open(_metrics_base(sc)) as conn,
    ):
        took, lines = await drip_until_answered(conn, b"GET /metrics HTTP/1.1\r\n",
                                                b"X-A: b\r\n", 0.1)  # fmt: skip
        assert took > 0.5
        assert lines <= 0.5 / 0.1 + 2  # one deadline for the whole head, not one per line
        resp = await conn.read_response(timeout=5)
        assert resp.status == 408
        assert resp.reason == b"Request Timeout"


@pytest.mark.anyio
@pytest.mark.in_memory
@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /metrics HTTP/1.1\r\nHost: m\r\nContent-Length: 3\r\n\r\nabc", 405),
        (b"GET /metrics HTTP/1.1\r\nHost: m\r\nContent-Length: 999999\r\n\r\n" + b"a" * 70000,
         413),
        (b"GET /metrics HTTP/1.1\r\nHost: m\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
         400),
        (b"GET /metrics HTTP/1.1\r\nHost: m\r\n" + b"X-Big: " + b"a" * 40000 + b"\r\n\r\n", 431),
    ],
)  # fmt: skip
async def test_metrics_listener_refuses_what_it_does_not_serve(
    sidecar: Sidecar, request_bytes: bytes, status: int
) -> None:
    async with await RawConn.open(_metrics_base(sidecar)) as conn:
        await conn.send(request_bytes)
        resp = await conn.read_response()
        assert resp.status == status
        assert resp.header(b"connection") == b"close"
        if status == 405:
            assert resp.header(b"allow") == b"GET, HEAD"
        assert await conn.wait_closed() == b""
    async with await RawConn.open(_metrics_base(sidecar)) as conn:
        await conn.send(b"HEAD /metrics HTTP/1.1\r\nHost: m\r\n\r\n")
        resp = await conn.read_response(head_only=True)
        assert resp.status == 200
        assert int(resp.header(b"content-length") or 0) > 0
        await conn.send(GET_HEALTHZ)  # the HEAD response had no body: still in sync
        assert (await conn.read_response()).body == b"ok\n"


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_a_bug_in_one_connection_ends_only_that_connection(
    fake: FakeUpstream, sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception escaping a connection handler is logged; other streams go on."""
    script = [sse_head(), *[x for i in range(20) for x in (("send", chunk(i)), ("sleep", 0.05))],
              ("send", b"data: [DONE]\n\n"), ("end",)]  # fmt: skip
    fake.route("/v1/chat/completions", script)
    stream = await RawConn.open(sidecar.url)
    await stream.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    )
    await stream.read_until(b"tok1")

    real = H11Stream.wait_first_byte
    assert sidecar.address is not None
    proxy_port = sidecar.address[1]

    async def broken(self: H11Stream) -> bool:
        if self.stream.extra(SocketAttribute.local_address)[1] == proxy_port:
            raise RuntimeError("a bug in the connection loop")
        return await real(self)

    monkeypatch.setattr(H11Stream, "wait_first_byte", broken)
    async with await RawConn.open(sidecar.url) as victim:
        await victim.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await victim.wait_closed() == b""  # closed, nothing half-written
    monkeypatch.setattr(H11Stream, "wait_first_byte", real)

    rest = await stream.read_until(b"data: [DONE]\n\n")
    assert b"tok19" in rest
    await stream.close()
    async with await RawConn.open(_metrics_base(sidecar)) as conn:
        await conn.send(GET_HEALTHZ)
        assert (await conn.read_response()).status == 200


def _stream(url: str, out: dict[str, object]) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", url, json={"stream": True}) as r:
                out["body"] = b"".join(r.iter_raw())
        except httpx.HTTPError as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_idle_metrics_connections_past_their_timeouts_leave_the_process_serving() -> None:
    """The two shapes of the old 30 s trap (the old idle timeout), on a real child process.

    A connection that never sends a byte (the old code then read an unset variable:
    the process exited and cut every stream), and one that scrapes once, stays idle
    past the timeout and then closes (the old code then spun on ``ConnectionClosed``: no
    port answered and SIGTERM was ignored).  The timeouts are set to half a second, and the
    test waits until the listener has ended both connections itself.
    """
    idle = 0.5
    n = 12  # a stream of three times the timeouts, which outlives both
    script = [sse_head(), *[x for i in range(n) for x in (("send", chunk(i)),
                                                          ("sleep", idle / 4))],
              ("send", b"data: [DONE]\n\n"), ("end",)]  # fmt: skip
    with fake_upstream_in_thread() as fake:
        fake.route("/v1/chat/completions", script)
        config = ephemeral_config(fake.url, header_timeout=idle, keepalive_timeout=idle)
        proc = start_subprocess(config)
        try:
            assert proc.metrics_url is not None
            base = proc.metrics_url.removesuffix("/metrics")
            host, port = base.removeprefix("http://").rsplit(":", 1)
            silent = socket.create_connection((host, int(port)))
            scraper = socket.create_connection((host, int(port)))
            scraper.sendall(GET_HEALTHZ)
            assert scraper.recv(4096).startswith(b"HTTP/1.1 200 ")
            out: dict[str, object] = {}
            t = _stream(proc.url + "/v1/chat/completions", out)
            for s in (silent, scraper):  # idle past the timeouts: the listener ends them
                s.settimeout(20)
                try:
                    while s.recv(4096):
                        pass
                except ConnectionResetError:
                    pass
            scraper.close()
            time.sleep(0.5)
            assert proc.alive(), "".join(proc.lines[-40:])
            assert httpx.get(base + "/healthz", timeout=3).text == "ok\n"
            assert httpx.get(proc.url + "/health", timeout=3).status_code in (200, 404)
            t.join(20)
            assert "error" not in out, out.get("error")
            body = out["body"]
            assert isinstance(body, bytes)
            assert body.endswith(b"data: [DONE]\n\n")
            assert body.count(b"data: {") == n
            silent.close()
        finally:
            code = proc.terminate(timeout=5)
        assert code == 0


FD_LIMIT = 64
_LIMITED_MAIN = (
    f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT})); "
    "from sidecar.cli.proxy import main; main()"
)


def test_at_the_descriptor_limit_the_sidecar_backs_off_and_answers_healthz() -> None:
    """``EMFILE``: back off, log once per interval, and keep answering ``/healthz``.

    A sidecar limited to 64 descriptors gets 100 idle client connections.  It used to
    retry ``accept`` ten times a second per listener with a log line each time (27 lines a
    second were seen), and the metrics listener was as stuck as the proxy.  Now the
    failures are reported once per interval, and a descriptor held in reserve lets the
    metrics listener answer.  Once the clients leave, the proxy serves again.
    """
    with fake_upstream_in_thread() as fake:
        config = ephemeral_config(fake.url, header_timeout=60.0)
        proc = ManagedProcess(
            [sys.executable, "-c", _LIMITED_MAIN, *config_argv(config)], "sidecar",
            {"PYTHONUNBUFFERED": "1"}, ready=lambda p: READY_RE.search(p.output()) is not None,
        ).start(20)  # fmt: skip
        try:
            m = READY_RE.search(proc.output())
            assert m is not None
            proxy, metrics = urlsplit(m.group(1)), urlsplit(m.group(2))
            assert proxy.hostname
            assert proxy.port
            assert metrics.hostname
            assert metrics.port
            idle = [socket.create_connection((proxy.hostname, proxy.port)) for _ in range(100)]
            try:
                # the sidecar reaches its limit; then it goes on trying to accept the rest,
                # backing off (a few tries a second, where it used to log 27 lines)
                deadline = time.monotonic() + 30
                while not any("accept failed" in line for line in proc.lines):
                    assert time.monotonic() < deadline, "".join(proc.lines[-20:])
                    time.sleep(0.05)
                time.sleep(1.0)
                failures = [line for line in proc.lines if "accept failed" in line]
                assert 1 <= len(failures) <= 2, failures
                assert "Too many open files" in failures[0]
                for _ in range(5):  # one after the other, each on a new connection
                    r = httpx.get(f"http://{metrics.hostname}:{metrics.port}/healthz", timeout=10)
                    assert (r.status_code, r.text) == (200, "ok\n")
            finally:
                for s in idle:
                    s.close()
            r = httpx.get(m.group(1) + "/health", timeout=10)  # the proxy recovers
            assert r.status_code == 200
        finally:
            proc.stop(5)

"""Measuring instruments and hostile clients for the fairness tests.

The sidecar under test runs in a child process (:func:`tests.support.sidecar.start_subprocess`)
so that what the hostile clients cost it is measured on its own event loop.  The two
instruments use blocking clients in threads of a process of their own
(:class:`Instruments`, ``python -m tests.hostile.load``), so their timestamps depend
neither on how busy the test's event loop is nor on who holds its GIL:

* :class:`ParkedStream`: one streaming request whose upstream parks, recorded by
  :func:`tests.support.sse_client.stream_sse` (when each read arrived); reports the
  longest gap between the park notice and the resume;
* :class:`HealthProbe`: ``GET /healthz`` on the metrics listener every ``every`` seconds
  (a new connection each time), recording each answer's latency.

Those times are the figures a reader wants (docs/benchmarks.md), but on a shared machine
they measure the machine as much as the sidecar: a process that is not scheduled for
300 ms misses a 100 ms bound whatever it does.  What the tests assert leaves the machine
out: the sidecar runs with a watch on its event loop (:func:`_watched_main`) that reports
the longest time between two turns of the loop less the time the loop's thread waited
for a CPU, which is how long the sidecar's own work (a parse that never yields, a thread
that holds the GIL, a blocking call) kept every stream and ``/healthz`` waiting.

The hostile clients are coroutines on raw sockets (:class:`~tests.support.rawclient.RawConn`)
that run until cancelled; :func:`measure_park` keeps them running until each kind has
done its quota, however slowly the machine lets them.
"""

from __future__ import annotations

import itertools
import json
import re
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx

from sidecar.config import Config, config_argv
from tests.support.fake_upstream import Script, chunk, sse_head
from tests.support.procs import ManagedProcess
from tests.support.rawclient import RawConn
from tests.support.sidecar import READY_RE, SidecarProcess, ephemeral_config
from tests.support.sse_client import stream_sse

PARK_ROUTE = "/v1/chat/completions"
REPO = Path(__file__).resolve().parents[2]


def parked_script(park: float) -> Script:
    """Two tokens, a park of ``park`` seconds with no upstream keepalive, two tokens."""
    return [sse_head(), ("send", chunk(0)), ("send", b": preempted\n\n"), ("sleep", park),
            ("send", b": resumed\n\n"), ("send", chunk(1)), ("send", b"data: [DONE]\n\n"),
            ("end",)]  # fmt: skip


def _addr(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname
    assert parts.port
    return parts.hostname, parts.port


@dataclass
class ParkedStream:
    """A streaming client in a thread: arrival time of every read, the park's longest gap."""

    url: str
    reads: list[tuple[float, bytes]] = field(default_factory=list)
    error: str | None = None

    def start(self) -> ParkedStream:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        def on_read(_: float, data: bytes) -> None:
            self.reads.append((time.monotonic(), data))

        try:
            log = stream_sse(self.url + PARK_ROUTE, {"stream": True}, 60, on_read=on_read)
            self.error = log.error
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the parked stream did not end"
        assert self.error is None, self.error

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.reads)

    def longest_park_gap(self) -> float:
        """Longest time between two reads from the park notice to the resume notice."""
        start = next(i for i, (_, d) in enumerate(self.reads) if b": preempted" in d)
        end = next(i for i, (_, d) in enumerate(self.reads) if b": resumed" in d)
        times = [t for t, _ in self.reads[start : end + 1]]
        assert len(times) >= 2
        return max(b - a for a, b in itertools.pairwise(times))


@dataclass
class HealthProbe:
    """``GET /healthz`` every ``every`` seconds until stopped; latencies in seconds."""

    base: str  # http://host:port of the metrics listener
    every: float = 0.1
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def start(self) -> HealthProbe:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        addr = _addr(self.base)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                with socket.create_connection(addr, timeout=10) as s:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: m\r\nConnection: close\r\n\r\n")
                    got = b""
                    while data := s.recv(4096):
                        got += data
                if not got.startswith(b"HTTP/1.1 200 ") or not got.endswith(b"ok\n"):
                    self.failures.append(repr(got[:80]))
            except OSError as exc:
                self.failures.append(repr(exc))
            self.latencies.append(time.monotonic() - t0)
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


# ------------------------------------------------------------------ hostile clients
# Each runs until cancelled and counts what it completed in ``done[its name]``.

CHUNK_FLOOD = b"1\r\nx\r\n" * 50_000
Done = Counter[str]


async def chunk_flood(url: str, done: Done) -> None:
    """Upload 50,000 one-byte chunks (300 KB on the wire) per request, as fast as possible."""
    while True:
        async with await RawConn.open(url) as c:
            await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            await c.send(CHUNK_FLOOD + b"0\r\n\r\n")
            resp = await c.read_response(timeout=60)
            assert resp.status == 200
            assert len(resp.body) == 50_000
        done["chunk_flood"] += 1


async def slow_body(url: str, done: Done, every: float = 0.5) -> None:
    """Declare 100 kB and send one byte every ``every`` seconds."""
    async with await RawConn.open(url) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        while True:
            await c.send(b"a")
            done["slow_body"] += 1
            await anyio.sleep(every)


async def byte_drip(url: str, done: Done, every: float = 0.005) -> None:
    """A request head one byte at a time, one every ``every`` seconds, over and over."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200 + b"\r\n\r\n"
    while True:
        async with await RawConn.open(url) as c:
            try:
                for i in range(len(head)):
                    await c.send(head[i : i + 1])
                    done["byte_drip_bytes"] += 1
                    await anyio.sleep(every)
                await c.read_response(timeout=30)
                done["byte_drip"] += 1
            except (anyio.BrokenResourceError, EOFError, ConnectionError):
                pass  # 408: the whole head took longer than header_timeout


async def huge_line(url: str, done: Done) -> None:
    """Read responses whose upstream sends one 16 MB SSE line (counted, then dropped)."""
    while True:
        stream = await anyio.connect_tcp(*_addr(url))
        async with stream:
            await stream.send(b"GET /huge-line HTTP/1.1\r\nHost: x\r\n"
                              b"Connection: close\r\n\r\n")  # fmt: skip
            try:
                while True:
                    done["huge_line_bytes"] += len(await stream.receive(1 << 20))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                done["huge_line"] += 1


async def header_flood(url: str, done: Done) -> None:
    """Heads of 6,000 tiny fields each, just under the size limit, over and over."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"a:b\r\n" * 6000 + b"\r\n"
    while True:
        async with await RawConn.open(url) as c:
            await c.send(head)
            await c.read_response(timeout=30)
            done["header_flood"] += 1


async def idle_keepalive(url: str, path: bytes, done: Done) -> None:
    """One request, then silence on the kept-alive connection; reconnects when closed."""
    while True:
        async with await RawConn.open(url) as c:
            await c.send(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            await c.read_response(timeout=30)
            done["idle_keepalive"] += 1
            await c.wait_closed(timeout=3600)


# Attacks on the priority rule (the sidecar under test runs with one: see measure_park).
MiB = 1024 * 1024
REWRITE_BODY = b'{"prompt":"x","n_predict":1,"a":[' + b"{}," * (10 * MiB) + b"{}]}"  # 30 MiB
BYPASS_BODY = b'{"prompt":"x","n_predict":1,"priority":1000000}'
BYPASSES: list[tuple[bytes, bytes]] = [
    (b"/v1/chat/completion%73", BYPASS_BODY),
    (b"/v1/chat%2Fcompletions", BYPASS_BODY),
    (b"/v1/chat/completions#x", BYPASS_BODY),
    (b"/completio%u006e", BYPASS_BODY),
    (b"/v1/responses", b'{"input":"x","priority":1000000}'),
    (b"/v1/messages", b'{"messages":[],"priority":1000000}'),
    (b"/completion", BYPASS_BODY + b"\x00"),
    (b"/completion", BYPASS_BODY[:-1] + b',"x":' + b"[" * 2000 + b"]" * 2000 + b"}"),
]


def _post(target: bytes, body: bytes) -> bytes:
    return (b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip


async def priority_bypass(url: str, done: Done) -> None:
    """The ways around a priority rule, one after the other (a new connection after each
    refusal: the sidecar closes after an error)."""
    attempts = itertools.cycle(BYPASSES)
    while True:
        async with await RawConn.open(url) as c:
            for target, body in attempts:
                await c.send(_post(target, body))
                resp = await c.read_response(timeout=60)
                done[f"priority_bypass_{resp.status}"] += 1
                if resp.header(b"connection") == b"close":
                    break


async def rewrite_30mib(url: str, done: Done) -> None:
    """A 30 MiB completion body of ten million empty objects, over and over."""
    while True:
        async with await RawConn.open(url) as c:
            await c.send(_post(b"/completion", REWRITE_BODY))
            resp = await c.read_response(timeout=120)
            assert resp.status == 200, resp.status
        done["rewrite_30mib"] += 1


async def stalled_reader(url: str, done: Done) -> None:
    """Ask for the 16 MB line, then never read a byte of it."""
    async with await RawConn.open(url) as c:
        await c.send(b"GET /huge-line HTTP/1.1\r\nHost: x\r\n\r\n")
        done["stalled_reader"] += 1
        await anyio.sleep_forever()


def huge_line_script(megabytes: int = 16, piece: int = 64 * 1024, every: float = 0.01) -> Script:
    """An event stream whose one ``data:`` line is ``megabytes`` MB long, then a newline.

    Sent at ``piece / every`` bytes per second (6.4 MB/s by default): a hostile line,
    not a bandwidth test of the machine the tests run on.
    """
    steps: Script = [sse_head(), ("send", b"data: ")]
    for _ in range(megabytes * 1024 * 1024 // piece):
        steps += [("send", b"x" * piece), ("sleep", every)]
    return [*steps, ("send", b"\n\n"), ("end",)]


# ------------------------------------------------------------ separate processes
# For the fairness test every part runs in a process of its own, so that what the
# sidecar's event loop does is all that is measured: the instruments at normal
# priority; the load (fake upstream, hostile clients) at a low one (nice 10), so that on a
# small machine it takes CPU time the sidecar leaves, as a remote attacker would.


class _Child:
    """``python -m tests.hostile.load ROLE ARGS...``; one JSON line on stdout at the end.

    Ready once it printed its first line (what it is, or where it listens); told to stop by
    closing its stdin.
    """

    def __init__(self, role: str, *args: str, nice: bool = False) -> None:
        self.process = ManagedProcess(
            [sys.executable, "-m", "tests.hostile.load", role, *args], f"load {role}",
            cwd=REPO, stdin=True, merge_stderr=False, nice=10 if nice else 0,
            ready=lambda p: bool(p.lines), poll_every=0.01,
        ).start(timeout=60)
        self.first_line = self.process.lines[0].strip()

    def finish(self, timeout: float = 60.0) -> Any:
        """Close its stdin (the signal to stop, where it waits for one); its JSON answer."""
        assert self.process.proc is not None
        assert self.process.proc.stdin is not None
        self.process.proc.stdin.close()
        self.process.wait(timeout)
        self.process.close()
        out = self.process.lines[-1] if len(self.process.lines) > 1 else ""
        return json.loads(out) if out.strip() else None

    def kill(self) -> None:
        self.process.kill()


class Instruments(_Child):
    """:class:`ParkedStream` and :class:`HealthProbe` in a child process.

    Constructed once the stream's first bytes arrived; :meth:`result` waits for the
    stream to end and returns both instruments, filled in.
    """

    def __init__(self, url: str, metrics_base: str, every: float = 0.1) -> None:
        self.url, self.metrics_base = url, metrics_base
        super().__init__("instruments", url, metrics_base, str(every))
        assert self.first_line == "streaming", self.first_line

    def streaming_done(self) -> bool:
        return not self.process.alive()

    def result(self, timeout: float = 60.0) -> tuple[ParkedStream, HealthProbe]:
        doc = self.finish(timeout)
        assert doc["error"] is None, doc["error"]
        reads = [(t, bytes.fromhex(d)) for t, d in doc["reads"]]
        probe = HealthProbe(self.metrics_base, latencies=doc["latencies"],
                            failures=doc["failures"])  # fmt: skip
        return ParkedStream(self.url, reads), probe


class FakeProcess(_Child):
    """The scripted upstream of the fairness test (park, huge line, echo), niced."""

    def __init__(self, park: float) -> None:
        super().__init__("upstream", str(park), nice=True)
        self.url = self.first_line


class HostileProcess(_Child):
    """The hostile clients (``{kind: how many}``), niced; :meth:`stop` -> what they did.

    :meth:`wait_for_quota` waits until the counts of ``quota`` (a minimum per name in
    ``done``) are all reached.
    """

    def __init__(self, url: str, metrics_base: str, kinds: Mapping[str, int],
                 quota: Mapping[str, int]) -> None:  # fmt: skip
        super().__init__("hostile", url, metrics_base, json.dumps(dict(kinds)),
                         json.dumps(dict(quota)), nice=True)  # fmt: skip
        assert self.first_line == "started", self.first_line

    def wait_for_quota(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.strip() == "quota done" for line in self.process.lines):
            assert time.monotonic() < deadline, "the hostile clients never did their quota"
            time.sleep(0.05)

    def stop(self) -> Done:
        return Counter(self.finish())


async def run_hostile(url: str, metrics: str, kinds: Mapping[str, int], done: Done,
                      stop: anyio.Event) -> None:  # fmt: skip
    """Every hostile client of ``kinds`` at once until ``stop`` is set."""
    starters = {
        "chunk_flood": lambda: chunk_flood(url, done),
        "slow_body": lambda: slow_body(url, done),
        "byte_drip": lambda: byte_drip(url, done),
        "header_flood": lambda: header_flood(url, done),
        "huge_line": lambda: huge_line(url, done),
        "idle_proxy": lambda: idle_keepalive(url, b"/health", done),
        "idle_metrics": lambda: idle_keepalive(metrics, b"/metrics", done),
        "priority_bypass": lambda: priority_bypass(url, done),
        "rewrite_30mib": lambda: rewrite_30mib(url, done),
        "stalled_reader": lambda: stalled_reader(url, done),
    }
    async with anyio.create_task_group() as tg:
        for kind, n in kinds.items():
            for _ in range(n):
                tg.start_soon(starters[kind])
        await stop.wait()
        tg.cancel_scope.cancel()


@dataclass
class Measured:
    """One run of the rig: the parked stream, the /healthz probe, the hostile work done,
    and the longest stall of the sidecar's loop in seconds (:func:`_watched_main`)."""

    stream: ParkedStream
    probe: HealthProbe
    done: Done
    stall: float

    @property
    def gap(self) -> float:
        return self.stream.longest_park_gap()

    def summary(self) -> str:
        lat = sorted(self.probe.latencies)
        return (f"longest park gap {self.gap:.3f} s; /healthz n={len(lat)} median "
                f"{lat[len(lat) // 2] * 1e3:.1f} ms max {lat[-1] * 1e3:.1f} ms; longest "
                f"stall of the loop {self.stall * 1e3:.1f} ms (less run-queue waits); "
                f"hostile work {dict(self.done)}")  # fmt: skip


def measure_park(kinds: Mapping[str, int], park: float, park_keepalive: float = 1.0,
                 quota: Mapping[str, int] | None = None, **options: Any) -> Measured:  # fmt: skip
    """A watched sidecar in its own process; a stream parked for ``park`` s while ``kinds``
    run, and the hostile clients go on until they did ``quota`` (``done`` counts).

    ``options`` are the sidecar's (a priority rule, say)."""
    fake = FakeProcess(park)
    proc = hostile = None
    try:
        proc = start_watched(ephemeral_config(fake.url, park_keepalive=park_keepalive,
                                              **options))  # fmt: skip
        assert proc.metrics_url is not None
        metrics = proc.metrics_url.removesuffix("/metrics")
        if kinds:  # first, so that they run through the whole park
            hostile = HostileProcess(proc.url, metrics, kinds, quota or {})
        instruments = Instruments(proc.url, metrics, every=0.1)
        stream, probe = instruments.result(timeout=park + 60)
        if hostile is not None:
            hostile.wait_for_quota(timeout=120)
        done = hostile.stop() if hostile is not None else Counter()
        assert proc.alive(), "".join(proc.lines[-30:])
    finally:
        for child in (hostile, fake):
            if child is not None:
                child.kill()
        if proc is not None:
            proc.terminate()
    stalls = [float(m.group(1)) for line in proc.lines if (m := _STALL_RE.search(line))]
    assert stalls, "".join(proc.lines[-30:])
    return Measured(stream, probe, done, max(stalls))


# ------------------------------------------------------------------ the watched sidecar
# The watch: a task wakes every _TICK seconds, and the time between two of its turns is a
# stall of the loop, less the time the loop's thread sat in the kernel's run queue
# (/proc/<pid>/task/<tid>/schedstat): what is left is its own work and its own waiting
# (a thread holding the GIL, a blocking call), never the machine's other load.  (A loop
# that never comes back is not reported: the /healthz probe fails instead.)

_TICK = 0.005
_STALL_RE = re.compile(r"^loop watch: ([0-9.]+) s between two turns")


def start_watched(config: Config, timeout: float = 20.0) -> SidecarProcess:
    """The ``proxy`` command with the loop watch, in a child process, listening."""
    process = ManagedProcess(
        [sys.executable, "-m", "tests.hostile.load", "sidecar", *config_argv(config)],
        "sidecar", {"PYTHONUNBUFFERED": "1"},
        ready=lambda p: READY_RE.search(p.output()) is not None,
    ).start(timeout)  # fmt: skip
    m = READY_RE.search(process.output())
    assert m is not None
    return SidecarProcess(process, m.group(1), m.group(2))


def _watched_main(*argv: str) -> None:
    import sidecar.cli.proxy as cli

    schedstat = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")

    def clock() -> tuple[float, float]:
        """Now, and how long the loop's thread has waited to run (both in seconds)."""
        now = time.monotonic()
        return now, int(schedstat.read_text().split()[1]) / 1e9

    async def tick() -> None:
        longest = 0.0
        then, queued_then = clock()
        while True:
            await anyio.sleep(_TICK)
            now, queued = clock()
            stall = (now - then) - (queued - queued_then)
            if stall > longest + 0.001:
                longest = stall
                print(f"loop watch: {stall:.4f} s between two turns", flush=True)
            then, queued_then = clock()

    real = cli._main

    async def watched(config: Config) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            await real(config)
            tg.cancel_scope.cancel()

    cli._main = watched  # type: ignore[assignment]
    sys.argv = ["llama-sidecar-proxy", *argv]
    cli.main()


def _hostile_main(url: str, metrics: str, kinds_json: str, quota_json: str) -> None:
    done: Done = Counter()
    quota: dict[str, int] = json.loads(quota_json)

    async def report_quota() -> None:
        while any(done[k] < n for k, n in quota.items()):
            await anyio.sleep(0.05)
        print("quota done", flush=True)

    async def main() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_hostile, url, metrics, json.loads(kinds_json), done, stop)
            print("started", flush=True)
            tg.start_soon(report_quota)
            await anyio.to_thread.run_sync(sys.stdin.read)  # until the parent closes it
            stop.set()
            tg.cancel_scope.cancel()

    anyio.run(main)
    json.dump(dict(done), sys.stdout)


def _upstream_main(park: str) -> None:
    from tests.support.fake_upstream import fake_upstream_in_thread

    with fake_upstream_in_thread() as fake:
        fake.route(PARK_ROUTE, parked_script(float(park)))
        fake.route("/huge-line", huge_line_script(16))
        fake.route("/completion", [("head", 200, [(b"Content-Type", b"application/json")]),
                                   ("send", b'{"content":"ok"}'), ("end",)])  # fmt: skip
        print(fake.url, flush=True)
        sys.stdin.read()


def _instruments_main(url: str, metrics_base: str, every: str) -> None:
    stream = ParkedStream(url).start()
    while not stream.reads:
        time.sleep(0.001)
    probe = HealthProbe(metrics_base, float(every)).start()
    print("streaming", flush=True)
    stream._thread.join(600)
    probe.stop()
    reads = [(t, d.hex()) for t, d in stream.reads]
    json.dump({"reads": reads, "latencies": probe.latencies, "failures": probe.failures,
               "error": stream.error}, sys.stdout)  # fmt: skip


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    {"instruments": _instruments_main, "hostile": _hostile_main,
     "upstream": _upstream_main, "sidecar": _watched_main}[role](*args)  # fmt: skip

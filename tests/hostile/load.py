"""Measuring instruments and hostile clients for the fairness tests.

The sidecar under test runs in a child process (:func:`sidecar.server.start_subprocess`)
so that what the hostile clients cost it is measured on its own event loop.  The two
instruments run in their own threads with blocking sockets, so their timestamps do not
depend on how busy the test's event loop is:

* :class:`ParkedStream`: one streaming request whose upstream parks; records when each
  read arrived and reports the longest gap between the park notice and the resume;
* :class:`HealthProbe`: ``GET /healthz`` on the metrics listener every ``every`` seconds
  (a new connection each time), recording each answer's latency.

The hostile clients are coroutines on raw sockets (:class:`~tests.proxy.rawclient.RawConn`)
that run until cancelled.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio

from tests.proxy.fake_upstream import Script, chunk, sse_head
from tests.proxy.rawclient import RawConn

PARK_ROUTE = "/v1/chat/completions"


def parked_script(park: float) -> Script:
    """Two tokens, a park of ``park`` seconds with no upstream keepalive, two tokens."""
    return [sse_head(), ("send", chunk(0)), ("send", b": preempted\n\n"), ("sleep", park),
            ("send", b": resumed\n\n"), ("send", chunk(1)), ("send", b"data: [DONE]\n\n"),
            ("end",)]  # fmt: skip


def _addr(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port
    return parts.hostname, parts.port


@dataclass
class ParkedStream:
    """A streaming client in a thread: arrival time of every read, the park's longest gap."""

    url: str
    reads: list[tuple[float, bytes]] = field(default_factory=list)
    error: BaseException | None = None

    def start(self) -> ParkedStream:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with socket.create_connection(_addr(self.url), timeout=60) as s:
                s.sendall(b"POST " + PARK_ROUTE.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 16\r\n\r\n"
                          b'{"stream": true}')  # fmt: skip
                while True:
                    data = s.recv(65536)
                    if not data:
                        return
                    self.reads.append((time.monotonic(), data))
                    if b"data: [DONE]" in data or b"\r\n0\r\n\r\n" in data:
                        return
        except OSError as exc:
            self.error = exc

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

CHUNK_FLOOD = b"1\r\nx\r\n" * 50_000


async def chunk_flood(url: str, rounds: int | None = None) -> int:
    """Upload 50,000 one-byte chunks (300 KB on the wire) per request, as fast as possible."""
    done = 0
    while rounds is None or done < rounds:
        async with await RawConn.open(url) as c:
            await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            await c.send(CHUNK_FLOOD + b"0\r\n\r\n")
            resp = await c.read_response(timeout=60)
            assert resp.status == 200 and len(resp.body) == 50_000
        done += 1
    return done


async def slow_body(url: str, every: float = 0.5) -> None:
    """Declare 100 kB and send one byte every ``every`` seconds."""
    async with await RawConn.open(url) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        while True:
            await c.send(b"a")
            await anyio.sleep(every)


async def byte_drip(url: str, every: float = 0.005) -> None:
    """A request head one byte at a time, one every ``every`` seconds, over and over."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200 + b"\r\n\r\n"
    while True:
        async with await RawConn.open(url) as c:
            try:
                for i in range(len(head)):
                    await c.send(head[i : i + 1])
                    await anyio.sleep(every)
                await c.read_response(timeout=30)
            except (anyio.BrokenResourceError, EOFError, ConnectionError):
                pass  # 408: the whole head took longer than header_timeout


async def huge_line(url: str) -> None:
    """Stream a response whose upstream sends one 16 MB SSE line with no newline."""
    while True:
        async with await RawConn.open(url) as c:
            await c.send(b"GET /huge-line HTTP/1.1\r\nHost: x\r\n\r\n")
            await c.read_response(timeout=120)


async def header_flood(url: str) -> None:
    """Heads of 6,000 tiny fields each, just under the size limit, over and over."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"a:b\r\n" * 6000 + b"\r\n"
    while True:
        async with await RawConn.open(url) as c:
            await c.send(head)
            await c.read_response(timeout=30)


async def idle_keepalive(url: str, path: bytes) -> None:
    """One request, then silence on the kept-alive connection; reconnects when closed."""
    while True:
        async with await RawConn.open(url) as c:
            await c.send(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            await c.read_response(timeout=30)
            await c.wait_closed(timeout=3600)


def huge_line_script(megabytes: int = 16, piece: int = 64 * 1024) -> Script:
    """An event stream whose one ``data:`` line is ``megabytes`` MB long, then a newline."""
    steps: Script = [sse_head(), ("send", b"data: ")]
    steps += [("send", b"x" * piece)] * (megabytes * 1024 * 1024 // piece)
    return [*steps, ("send", b"\n\n"), ("end",)]

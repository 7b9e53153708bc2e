"""A tiny raw HTTP/1.1 client on anyio sockets, for malformed input and precise timing.

:meth:`RawConn.read_response` parses what comes back without any leniency of its own
(status line, fields, a body framed by Content-Length, chunked or the end of the
connection), so a test sees exactly the bytes the sidecar wrote.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio
import anyio.abc

from tests.support.memnet import open_stream


class RawConn:
    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.buf = b""
        self.eof = False
        self.closed_at: float | None = None

    @classmethod
    async def open(cls, url: str) -> RawConn:
        """A connection to ``url``: in memory if the test's net serves it, else TCP."""
        return cls(await open_stream(url))

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def _fill(self) -> bool:
        try:
            data = await self.stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def read_until(self, marker: bytes, timeout: float = 10.0) -> bytes:
        with anyio.fail_after(timeout):
            while marker not in self.buf:
                if not await self._fill():
                    raise EOFError(f"EOF before {marker!r}; got {self.buf!r}")
        idx = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:idx], self.buf[idx:]
        return out

    async def read_to_eof(self, timeout: float = 10.0) -> bytes:
        with anyio.fail_after(timeout):
            while await self._fill():
                pass
        out, self.buf = self.buf, b""
        return out

    async def read_exactly(self, n: int, timeout: float = 10.0) -> bytes:
        with anyio.fail_after(timeout):
            while len(self.buf) < n:
                if not await self._fill():
                    raise EOFError(f"EOF after {len(self.buf)} of {n} bytes")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def read_response(self, timeout: float = 10.0, *, head_only: bool = False) -> Response:
        """One response: its head, and its body unless ``head_only`` (HEAD, 204, 304)."""
        with anyio.fail_after(timeout):
            raw_head = await self.read_until(b"\r\n\r\n", timeout)
            status_line, *lines = raw_head[:-4].split(b"\r\n")
            _version, status, reason = [*status_line.split(b" ", 2), b""][:3]
            resp = Response(int(status), reason, raw_head)
            for line in lines:
                name, _, value = line.partition(b":")
                resp.headers.append((name.strip().lower(), value.strip()))
            if head_only or resp.status in (204, 304) or 100 <= resp.status < 200:
                return resp
            if resp.header(b"transfer-encoding") is not None:
                resp.chunked = True
                while True:
                    size_line = await self.read_until(b"\r\n", timeout)
                    size = int(size_line.split(b";")[0], 16)
                    if size == 0:
                        await self.read_until(b"\r\n", timeout)  # no trailers expected
                        break
                    resp.body += await self.read_exactly(size, timeout)
                    assert await self.read_exactly(2, timeout) == b"\r\n", "bad chunk end"
            elif (cl := resp.header(b"content-length")) is not None:
                resp.body = await self.read_exactly(int(cl), timeout)
            else:
                resp.body = await self.read_to_eof(timeout)
        return resp

    async def wait_closed(self, timeout: float = 10.0) -> bytes:
        """Wait until the peer closes; returns whatever it sent before."""
        return await self.read_to_eof(timeout)

    async def close(self) -> float:
        """Close now; returns the monotonic close time."""
        await self.stream.aclose()
        self.closed_at = time.monotonic()
        return self.closed_at

    async def __aenter__(self) -> RawConn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stream.aclose()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


@dataclass
class Response:
    status: int
    reason: bytes
    raw_head: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    chunked: bool = False

    def header(self, name: bytes) -> bytes | None:
        """The first value of ``name`` (lower case), or None."""
        for n, v in self.headers:
            if n == name:
                return v
        return None

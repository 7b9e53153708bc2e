"""A tiny raw HTTP/1.1 client on anyio sockets, for malformed input and precise timing."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import anyio
import anyio.abc


class RawConn:
    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.buf = b""
        self.eof = False
        self.closed_at: float | None = None

    @classmethod
    async def open(cls, url: str) -> RawConn:
        parts = urlsplit(url)
        assert parts.hostname and parts.port
        return cls(await anyio.connect_tcp(parts.hostname, parts.port))

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

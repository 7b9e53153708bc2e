"""An Exchange between an in-memory client and a scripted in-memory upstream.

:class:`Harness` owns a sidecar's shared state (:class:`~sidecar.proxy.relay.Context`
with a fresh metrics registry and an :class:`~sidecar.proxy.upstream.UpstreamPool`
whose ``connect`` makes :func:`~tests.protocol.memory.memory_pair` connections),
runs the sidecar's connection loop (:func:`~sidecar.proxy.server.serve_connection`) for one
client connection, and hands each upstream connection the sidecar opens to the test's
script as an :class:`UpstreamEnd`.  No socket is opened anywhere.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import h11
from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.proxy.metrics import Metrics
from sidecar.proxy.relay import Context, Exchange
from sidecar.proxy.server import serve_connection
from sidecar.proxy.transport import TransportStream
from sidecar.proxy.upstream import UpstreamPool
from tests.protocol.memory import memory_pair

PEER = "203.0.113.9"


class End:
    """The test's end of an in-memory connection: raw bytes in and out."""

    def __init__(self, stream: TransportStream) -> None:
        self.stream = stream
        self.buf = b""
        self.seen = b""  # every byte received, read or not

    async def _more(self) -> bytes:
        data = await self.stream.receive()
        self.seen += data
        return data

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def read_until(self, marker: bytes) -> bytes:
        """Everything up to and including ``marker`` (the rest stays buffered)."""
        while marker not in self.buf:
            self.buf += await self._more()
        cut = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    async def read_to_eof(self) -> bytes:
        """Everything until the other end closes."""
        try:
            while True:
                self.buf += await self._more()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
        out, self.buf = self.buf, b""
        return out

    async def close(self) -> None:
        await self.stream.aclose()


class UpstreamEnd(End):
    async def read_request(self) -> tuple[bytes, bytes]:
        """One request: its head and its ``Content-Length`` body."""
        head = await self.read_until(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(self.buf) < length:
            self.buf += await self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return head, body

    async def wait_closed(self) -> None:
        """Until the sidecar closed this connection."""
        while not self.stream.at_eof:
            try:
                self.buf += await self._more()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return


class ClientEnd(End):
    async def response(self) -> tuple[h11.Response, bytes]:
        """One whole response, parsed by h11 (the body decoded)."""
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        conn.send(h11.EndOfMessage())
        if self.buf:  # b"" would mean end of stream to h11
            conn.receive_data(self.buf)
            self.buf = b""
        head: h11.Response | None = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self._more())
            elif isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                self.buf = conn.trailing_data[0]
                return head, body


Script = Callable[[UpstreamEnd], Awaitable[None]]


class Harness:
    def __init__(self, script: Script | None, **config: Any) -> None:
        config.setdefault("upstream", "http://127.0.0.1:9")
        config.setdefault("metrics_listen", None)
        self.config = Config(**config)
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.pool = UpstreamPool(self.config, connect=self._connect)
        self.ctx = Context(self.config, self.metrics, self.pool)
        self.script = script
        self.upstreams: list[UpstreamEnd] = []
        self.exchanges: list[Exchange] = []
        self._tg: anyio.abc.TaskGroup | None = None

    async def _connect(self, host: str, port: int) -> TransportStream:
        if self.script is None:
            raise ConnectionRefusedError(111, "Connection refused")
        ours, theirs = memory_pair()
        end = UpstreamEnd(theirs)
        self.upstreams.append(end)
        assert self._tg is not None
        self._tg.start_soon(self.script, end)
        return ours

    async def _serve(self, stream: TransportStream) -> None:
        try:
            await serve_connection(self.ctx, stream, started=self.exchanges.append)
        finally:
            await stream.aclose()

    @asynccontextmanager
    async def client(self) -> AsyncIterator[ClientEnd]:
        """A client connection served by the connection loop until it ends."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            ours, theirs = memory_pair((PEER, 40000))
            tg.start_soon(self._serve, theirs)
            end = ClientEnd(ours)
            try:
                yield end
            finally:
                with anyio.fail_after(5):
                    await end.close()
                    await self.ctx.wait_idle()
                    await self.pool.aclose()
                tg.cancel_scope.cancel()

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

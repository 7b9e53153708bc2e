"""Byte streams on asyncio transports that the sidecar owns (asyncio or uvloop).

Theory of operation
-------------------
anyio's asyncio ``SocketStream`` pauses reading between ``receive`` calls and
re-arms it in epoll on every call, and every ``send`` that did not block yields
to the event loop once more.  For a relay that forwards one SSE event per read
that machinery was most of the cost per event (docs/benchmarks.md, "Sidecar
relay").  :class:`TransportStream` is an ``anyio.abc.ByteStream`` implemented
directly as an ``asyncio.Protocol``, so the rest of the sidecar (``H11Stream``,
cancel scopes, task groups) uses it unchanged:

* **Reading stays enabled.**  ``data_received`` queues the bytes and wakes the
  one waiting ``receive``; a ``receive`` that finds bytes queued returns them
  without a trip through the loop.  Above ``READ_HIGH_WATER`` queued bytes the
  transport stops reading (flow control) until the reader has caught up.
* **Writes are synchronous.**  ``send`` hands the bytes to the transport at
  once and waits only while the transport's buffer is non-empty after the write
  (write buffer limit 0, as in anyio: back-pressure comes from the kernel
  buffer, and :meth:`aclose` never discards data a finished ``send`` wrote).
  Because a write never yields before it is done, two writers on the loop
  thread can never interleave inside one write; :meth:`write` is the same write
  for callers that cannot await (timer callbacks, sinks).
* **A sink** (:meth:`set_sink`) takes the place of ``receive`` for a streamed
  response body: ``data_received`` calls ``sink.feed`` directly, so relaying an
  event costs no task switch at all.  The sink applies back-pressure with
  :meth:`pause_reading` / :meth:`resume_reading` and learns about the end of
  the connection from ``sink.lost``.  Only the stream's owner (the relay pump
  of the exchange using the connection) installs and removes a sink.

* **A send timeout** (:meth:`set_send_timeout`, nginx's ``send_timeout``):
  while written bytes wait in the transport's buffer (the kernel's is full: the
  peer stopped reading), a timer checks every ``send_timeout`` seconds that the
  peer took some bytes since the last check.  A peer that took nothing for that
  long is cut off (:attr:`send_timed_out`, then the connection is aborted):
  whoever waits on it sees the connection lost, whoever writes to it fails.
  Progress is counted in bytes the peer acknowledged (written, less what waits
  in the transport and in the kernel's send queue, ``TIOCOUTQ``): the socket
  becomes writable again only once a third of a send buffer of megabytes has
  drained, so a slow reader that keeps reading would look stalled to a check
  on writability alone.  A full buffer is checked whether or not a task waits
  on it (a parked stream's keepalive comments are written from a timer).

Cancellation works as with anyio's own streams: on asyncio a cancelled scope
cancels the task, which raises ``CancelledError`` at the awaited future.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any, Protocol, cast

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

__all__ = ["READ_HIGH_WATER", "Sink", "TransportStream"]

# Queued-but-unread bytes at which reading pauses, and resumes below a quarter.
READ_HIGH_WATER = 256 * 1024
# the ioctl that gives the bytes of a socket's send queue not yet acknowledged (Linux)
_TIOCOUTQ: int | None = getattr(termios, "TIOCOUTQ", None)


class Sink(Protocol):
    def feed(self, data: bytes) -> None:
        """Bytes read from the connection (called from ``data_received``)."""

    def lost(self, exc: BaseException | None) -> None:
        """End of input: EOF (``None``) or the connection failed."""


class TransportStream(anyio.abc.ByteStream, asyncio.Protocol):
    """One TCP connection: a protocol for the loop, a byte stream for tasks."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._chunks: deque[bytes] = deque()
        self._queued = 0
        self._eof = False
        self._lost = False
        self._error: BaseException | None = None
        self._closed = False
        self._read_paused = False
        self._write_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None
        self._written = 0  # bytes handed to the transport
        self._send_timeout: float | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._sent_mark = 0
        self.send_timed_out = False

    # ------------------------------------------------------------ protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: cast, not check.
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        transport.set_write_buffer_limits(0)

    def data_received(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            sink.feed(data)
            return
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued > READ_HIGH_WATER and not self._read_paused:
            self.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        if self._sink is not None:
            self._sink.lost(None)
        return True  # keep the write side open (a half-closed peer still reads)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._stop_send_timer()
        if exc is not None:
            self._error = exc
        self._wake()
        self._wake_drain()
        if self._sink is not None:
            self._sink.lost(exc)

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._send_timeout is not None and self._send_timer is None:
            self._sent_mark = self._sent()
            self._send_timer = self._loop.call_later(self._send_timeout, self._send_check)

    def resume_writing(self) -> None:
        self._write_paused = False
        self._stop_send_timer()
        self._wake_drain()

    # --------------------------------------------------------- send timeout

    def set_send_timeout(self, seconds: float | None) -> None:
        """Cut the peer off once it has taken no byte for ``seconds`` (None: never)."""
        self._send_timeout = seconds

    def _sent(self) -> int:
        """Bytes the peer took: written, less what waits in the transport and the kernel."""
        transport = self._transport
        if transport is None:
            return self._written
        waiting = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if _TIOCOUTQ is not None and sock is not None:
            try:
                queued = fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0")
                waiting += struct.unpack("i", queued)[0]
            except (OSError, ValueError):
                pass  # then bytes that reached the kernel count as taken
        return self._written - waiting

    def _send_check(self) -> None:
        self._send_timer = None
        if not self._write_paused or self._lost or self._closed:
            return
        sent = self._sent()
        if sent > self._sent_mark:
            self._sent_mark = sent  # the peer is reading, however slowly
            assert self._send_timeout is not None
            self._send_timer = self._loop.call_later(self._send_timeout, self._send_check)
            return
        self.send_timed_out = True
        if self._transport is not None:
            self._transport.abort()  # connection_lost follows: waiters wake, writes fail

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drain(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --------------------------------------------------------- flow control

    def pause_reading(self) -> None:
        if not self._read_paused and self._transport is not None and not self._lost:
            self._read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._read_paused and self._transport is not None and not self._lost:
            self._read_paused = False
            self._transport.resume_reading()

    @property
    def write_paused(self) -> bool:
        """True while the kernel buffer is full and written bytes wait in ours."""
        return self._write_paused

    def set_sink(self, sink: Sink | None) -> bytes:
        """Route incoming bytes to ``sink`` (None: back to ``receive``).

        Returns the bytes already queued, which the caller feeds to the sink
        itself (so it sees every byte, in order).
        """
        self._sink = sink
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._queued = 0
        if sink is None:
            return data
        self.resume_reading()
        return data

    @property
    def at_eof(self) -> bool:
        """The peer closed its side (or the connection is gone)."""
        return self._eof or self._lost

    @property
    def has_queued(self) -> bool:
        return bool(self._chunks)

    # ---------------------------------------------------------- byte stream

    async def receive(self, max_bytes: int = 65536) -> bytes:
        chunks = self._chunks
        if not chunks:
            if self._closed:
                raise anyio.ClosedResourceError
            if not (self._eof or self._lost):
                waiter = self._waiter = self._loop.create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
            if not chunks:
                if self._closed:
                    raise anyio.ClosedResourceError
                if self._error is not None:
                    raise anyio.BrokenResourceError from self._error
                raise anyio.EndOfStream
        data = chunks.popleft()
        while chunks and len(data) + len(chunks[0]) <= max_bytes:
            data += chunks.popleft()
        if len(data) > max_bytes:
            data, rest = data[:max_bytes], data[max_bytes:]
            chunks.appendleft(rest)
        self._queued -= len(data)
        if self._read_paused and self._queued <= READ_HIGH_WATER // 4:
            self.resume_reading()
        return data

    def write(self, data: bytes) -> None:
        """Hand ``data`` to the transport now (no waiting: see the module docstring)."""
        if self._closed:
            raise anyio.ClosedResourceError
        transport = self._transport
        if self._lost or transport is None or transport.is_closing():
            raise anyio.BrokenResourceError from self._error
        self._written += len(data)
        transport.write(data)

    async def send(self, item: bytes) -> None:
        self.write(item)
        if self._write_paused:
            await self.drain()

    async def drain(self) -> None:
        """Wait until the bytes written so far have reached the kernel."""
        while self._write_paused and not self._lost:
            waiter = self._drain_waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._drain_waiter = None
        if self._closed:
            raise anyio.ClosedResourceError
        if self._lost:
            raise anyio.BrokenResourceError from self._error

    async def send_eof(self) -> None:
        if self._transport is not None and self._transport.can_write_eof():
            with suppress(OSError):
                self._transport.write_eof()

    async def aclose(self) -> None:
        """Close at once (anyio's semantics: unsent bytes are dropped)."""
        self._closed = True
        self._sink = None
        self._stop_send_timer()
        if self._transport is not None:
            self._transport.abort()
        self._wake()
        self._wake_drain()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        transport = self._transport
        if transport is None:
            return {}
        sock = transport.get_extra_info("socket")
        return {
            SocketAttribute.raw_socket: lambda: sock,
            SocketAttribute.family: lambda: sock.family,
            SocketAttribute.local_address: lambda: transport.get_extra_info("sockname"),
            SocketAttribute.remote_address: lambda: transport.get_extra_info("peername"),
        }


async def connect(host: str, port: int) -> TransportStream:
    """Open a TCP connection as a :class:`TransportStream` (``OSError`` on failure)."""
    loop = asyncio.get_running_loop()
    _, stream = await loop.create_connection(TransportStream, host, port)
    return stream


async def accepted(sock: socket.socket, send_timeout: float | None = None) -> TransportStream:
    """Wrap a freshly accepted socket (see :meth:`TransportStream.set_send_timeout`)."""
    loop = asyncio.get_running_loop()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _, stream = await loop.connect_accepted_socket(TransportStream, sock)
    stream.set_send_timeout(send_timeout)
    return stream

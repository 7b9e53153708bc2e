"""In-memory connections for driving an Exchange without sockets.

:func:`memory_pair` joins two :class:`~sidecar.proxy.transport.TransportStream` objects
with two :class:`MemoryTransport` objects: what one end writes reaches the other
end's ``data_received`` on the next loop iteration (``call_soon``, as a real
transport would deliver it, never inside the writer's call), in order.  Pausing
reading holds incoming bytes (and whatever arrives behind them) until reading
resumes; closing one end gives the other end EOF.  The sidecar's code runs
unchanged on top: the H11Stream, the upstream pool (given a ``connect`` that returns
such a stream), the body sink, the relay and its keepalive timer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sidecar.proxy.transport import TransportStream


class MemoryTransport(asyncio.Transport):
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol: asyncio.Protocol,
        sockname: tuple[str, int],
    ) -> None:
        super().__init__()
        self.sockname = sockname
        self._loop = loop
        self._protocol = protocol
        self.peer: MemoryTransport | None = None
        self._closing = False
        self._paused = False
        self._held: list[bytes] = []
        self._eof_held = False
        self.written = bytearray()  # everything this end wrote, for inspection

    # ------------------------------------------------------------ writing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            raise ConnectionResetError("write on a closed memory transport")
        data = bytes(data)
        self.written += data
        peer = self.peer
        if peer is not None and data:
            self._loop.call_soon(peer._arrive, data)

    def write_eof(self) -> None:
        if self.peer is not None:
            self._loop.call_soon(self.peer._arrive_eof)

    def can_write_eof(self) -> bool:
        return True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    # ------------------------------------------------------------ reading

    def _arrive(self, data: bytes) -> None:
        if self._closing:
            return
        if self._paused or self._held:
            # behind bytes held back: delivered in order by _flush
            self._held.append(data)
            return
        self._protocol.data_received(data)

    def _arrive_eof(self) -> None:
        if self._closing:
            return
        if self._paused or self._held:
            self._eof_held = True
            return
        self._protocol.eof_received()

    def _flush(self) -> None:
        while self._held and not self._paused and not self._closing:
            self._protocol.data_received(self._held.pop(0))
        if self._eof_held and not self._held and not self._paused and not self._closing:
            self._eof_held = False
            self._protocol.eof_received()

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        self._paused = False
        if self._held or self._eof_held:
            self._loop.call_soon(self._flush)

    def is_reading(self) -> bool:
        return not self._paused

    # ------------------------------------------------------------ closing

    def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.call_soon(self._protocol.connection_lost, None)
        if self.peer is not None:
            self._loop.call_soon(self.peer._arrive_eof)

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        peer = self.peer
        names = {"sockname": self.sockname, "peername": None if peer is None else peer.sockname}
        return names.get(name, default)


def memory_pair(
    a_address: tuple[str, int] = ("192.0.2.7", 40000),
    b_address: tuple[str, int] = ("192.0.2.1", 8081),
) -> tuple[TransportStream, TransportStream]:
    """Two connected TransportStreams (call from a running loop).

    Each end's own address is ``a_address`` and ``b_address``; the other end reads it as
    its remote address (the sidecar takes ``X-Forwarded-For`` from it).
    """
    loop = asyncio.get_running_loop()
    a, b = TransportStream(), TransportStream()
    ta, tb = MemoryTransport(loop, a, a_address), MemoryTransport(loop, b, b_address)
    ta.peer, tb.peer = tb, ta
    a.connection_made(ta)
    b.connection_made(tb)
    return a, b

"""pytest-benchmark: one read + one write on a TransportStream, per loop flavour.

Two streams on a socketpair bounce a 230-byte message back and forth from their
sinks (the relay's hot path: read callback -> write), ``HOPS`` times.  Compares
the plain ``Protocol`` stream (``sock.recv(256 KiB)`` per read) with the
``BufferedProtocol`` one (``recv_into`` a shared buffer) that the sidecar uses
on asyncio's selector loop; see sidecar/transport.py.  Run:
``pytest tests/bench/test_sidecar_transport.py --benchmark-enable``.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from sidecar.transport import BufferedTransportStream, TransportStream

HOPS = 2000
MSG = b"x" * 230


class _Bounce:
    def __init__(self, other: TransportStream, count: list[int], done: asyncio.Future[None]):
        self.other = other
        self.count = count
        self.done = done

    def feed(self, data: bytes) -> None:
        self.count[0] += 1
        if self.count[0] >= HOPS:
            if not self.done.done():
                self.done.set_result(None)
            return
        self.other.write(data)

    def lost(self, exc: BaseException | None) -> None:
        pass


async def _ping_pong(cls: type[TransportStream]) -> int:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    _, sa = await loop.connect_accepted_socket(cls, a)
    _, sb = await loop.connect_accepted_socket(cls, b)
    done: asyncio.Future[None] = loop.create_future()
    count = [0]
    sa.set_sink(_Bounce(sb, count, done))
    sb.set_sink(_Bounce(sa, count, done))
    sa.write(MSG)
    await done
    await sa.aclose()
    await sb.aclose()
    return count[0]


@pytest.mark.parametrize("cls", [TransportStream, BufferedTransportStream])
def test_ping_pong(benchmark: Any, cls: type[TransportStream]) -> None:
    loop = asyncio.new_event_loop()
    try:
        assert benchmark(lambda: loop.run_until_complete(_ping_pong(cls))) == HOPS
    finally:
        loop.close()

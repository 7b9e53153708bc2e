"""A large request body goes upstream in bounded steps, however fast upstream reads.

Writes to upstream wait only while the kernel's buffer is full.  An upstream that reads as
fast as the sidecar writes (llama-server's HTTP thread with a core to itself) never fills it,
so a 30 MiB body was written in one step of the event loop: about 90 ms of CPU per body,
and the fairness run's three rewrites at once held every stream for 0.27-0.7 s now and then
on an idle machine (under load, the upstream fell behind and the writes waited).  Here the
upstream end is in memory, a peer that takes every byte at once: the bytes written between
two turns of a task beside the exchange are counted, so the bound does not depend on the
machine's speed.
"""

from __future__ import annotations

from collections import Counter

import anyio
import anyio.lowlevel
import h11
import pytest

from sidecar.proxy.h11stream import H11Stream
from sidecar.proxy.upstream import SEND_STEP_BYTES, RequestBody, _exchange_head
from tests.protocol.memory import memory_pair

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024
BODY = 8 * MiB


class Arrivals:
    """The upstream end's sink: how many bytes arrived at each turn of the ticker."""

    def __init__(self) -> None:
        self.turn = 0
        self.by_turn: Counter[int] = Counter()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.by_turn[self.turn] += len(data)
        self.total += len(data)

    def lost(self, exc: BaseException | None) -> None:
        pass


@pytest.mark.parametrize("in_memory", [16 * MiB, 0], ids=["in_memory", "on_disk"])
async def test_a_large_body_goes_upstream_with_the_loop_turning(in_memory: int) -> None:
    sidecar_end, upstream_end = memory_pair()
    arrivals = Arrivals()
    upstream_end.set_sink(arrivals)
    upstream_end.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")  # read after the body
    body = RequestBody(in_memory)
    piece = b"{}," * (RequestBody.SEND_SIZE // 3)
    while body.size < BODY:
        body.append(piece)
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            await anyio.lowlevel.checkpoint()
            arrivals.turn += 1

    conn = H11Stream(sidecar_end, h11.CLIENT)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            head = await _exchange_head(conn, b"POST", b"/completion", [(b"Host", b"u"),
                                        (b"Content-Length", b"%d" % body.size)], body)  # fmt: skip
            done.set()
    finally:
        body.close()
    assert head.status == 200
    assert arrivals.total > body.size  # the head, then every byte of the body
    # one step is SEND_STEP_BYTES of body (plus the head and the piece that crossed the mark)
    assert max(arrivals.by_turn.values()) <= SEND_STEP_BYTES + RequestBody.SEND_SIZE
    assert len(arrivals.by_turn) >= body.size // (SEND_STEP_BYTES + RequestBody.SEND_SIZE)

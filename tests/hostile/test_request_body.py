"""Findings 2 and 6: request bodies are read in full, in bounded steps, before upstream.

6. A slow body held a llama-server HTTP thread for as long as the client liked (200
   clients sending 1 byte of a 100 kB body: 205 server threads), and the 60 s body
   timeout was per read.  Bodies are now buffered (memory, then a temporary file)
   before the upstream connection is opened, with one deadline for the whole body.
2. A body of 1-byte chunks was parsed and written upstream one h11 event at a time with
   no await point that yields: seconds of CPU during which no other stream got a byte.
   Now at most a few hundred chunks are parsed per step, the loop yields between
   steps, and upstream gets the body in large writes.
"""

from __future__ import annotations

import time

import anyio
import pytest

from sidecar.proxy.server import Sidecar
from tests.hostile.load import measure_park
from tests.hostile.test_fairness import STALL_BOUND
from tests.support.fake_upstream import FakeUpstream
from tests.support.fixtures import SidecarFactory
from tests.support.rawclient import RawConn


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_slow_bodies_hold_no_upstream_connection(
    fake: FakeUpstream, sidecar: Sidecar
) -> None:
    clients = [await RawConn.open(sidecar.url) for _ in range(50)]
    try:
        for c in clients:
            await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\na")
        await anyio.sleep(0.5)
        assert fake.conns == []  # llama-server would have 50 threads waiting
        await clients[0].send(b"b" * 99_999)
        resp = await clients[0].read_response()
        assert resp.status == 200
        assert resp.body == b"a" + b"b" * 99_999
        assert len(fake.conns) == 1
        head = fake.requests[0]
        assert dict(head.headers)[b"Content-Length"] == b"100000"
    finally:
        for c in clients:
            await c.close()


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_one_deadline_for_the_whole_body(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    """A byte every 0.2 s never trips a per-read timeout; the total deadline does.

    The bytes are counted on the loop the deadline runs on (in memory), so their number
    bounds the deadline whatever the machine's load."""
    sent = 0
    async with (
        sidecar_factory(fake.url, body_timeout=1.0) as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:

            async def drip() -> None:
                nonlocal sent
                while True:
                    await c.send(b"a")
                    sent += 1
                    await anyio.sleep(0.2)

            tg.start_soon(drip)
            status_line = await c.read_until(b"\r\n", timeout=5)
            tg.cancel_scope.cancel()
        assert status_line.startswith(b"HTTP/1.1 408 Request Timeout")
        assert time.monotonic() - t0 > 0.9
        assert sent <= 1.0 / 0.2 + 2  # one deadline for the body, not one per read
        assert fake.conns == []


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_chunked_body_over_the_limit_gets_413(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    async with (
        sidecar_factory(fake.url, max_body=10_000) as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.send(b"1000\r\n" + b"a" * 4096 + b"\r\n" * 1)
        await c.send(b"2000\r\n" + b"a" * 8192 + b"\r\n")
        resp = await c.read_response()
        assert resp.status == 413
        assert resp.reason
    assert fake.conns == []


@pytest.mark.anyio
@pytest.mark.in_memory
@pytest.mark.parametrize(
    ("size", "status"), [(b"f" * 15, 413), (b"1" + b"0" * 16, 400)], ids=["huge", "overflow"]
)
async def test_an_oversized_chunk_is_body_until_the_limit(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, size: bytes, status: int
) -> None:
    """A chunk size beyond any limit makes what follows body bytes, never a request;
    one longer than 16 hex digits (past 2**64) is refused at once."""
    async with (
        sidecar_factory(fake.url, max_body=1000) as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + size + b"\r\n" + b"GET /x HTTP/1.1\r\n\r\n" * 60)  # fmt: skip
        assert (await c.read_response()).status == status
    assert fake.conns == []


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_a_body_larger_than_the_buffer_spills_and_arrives_intact(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    body = bytes(range(256)) * 4000  # 1 MB
    async with (
        sidecar_factory(fake.url, body_buffer=64 * 1024) as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 3000):
            piece = body[i : i + 3000]
            await c.send(b"%x\r\n%b\r\n" % (len(piece), piece))
        await c.send(b"0\r\n\r\n")
        resp = await c.read_response()
        assert resp.status == 200
        assert resp.body == body
    assert fake.requests[0].body == body


@pytest.mark.slow
@pytest.mark.serial  # the same loop-stall bound as the fairness tests
def test_a_chunk_flood_stalls_no_other_stream() -> None:
    """50,000 one-byte chunks per upload, two uploaders back to back, during a park.

    The old code spent seconds per upload without yielding: the parked stream went
    4.5 s without a byte (its promise is the 1 s park keepalive) and /healthz waited 6 s.
    Now no turn of the sidecar's loop takes long (its waits for a CPU left out: see
    :mod:`tests.hostile.load`), however busy the machine.
    """
    run = measure_park({"chunk_flood": 2}, park=2.5, park_keepalive=0.5,
                       quota={"chunk_flood": 2})  # fmt: skip
    print(f"\nchunk flood: {run.summary()}")
    assert run.stall <= STALL_BOUND, f"the sidecar held its loop for {run.stall:.3f} s"
    assert not run.probe.failures, run.probe.failures
    assert run.stream.body.count(b": preempt-keepalive") >= 2.5 / 0.5 / 2
    assert run.done["chunk_flood"] >= 2, "the uploads did not get through"

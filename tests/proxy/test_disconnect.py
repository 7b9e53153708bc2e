"""Client disconnect in every phase closes the upstream connection within 100 ms."""

from __future__ import annotations

import anyio
import pytest

from sidecar.proxy.server import Sidecar
from tests.support.fake_upstream import FakeUpstream, chunk, sse_head
from tests.support.rawclient import RawConn
from tests.support.samples import sample

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]

REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b'Content-Length: 16\r\n\r\n{"stream": true}'
)
STREAMING = [sse_head(), *[x for i in range(10_000) for x in (("send", chunk(i)), ("sleep", 0.02))]]
SCRIPTS = {
    # no upstream head yet: llama-server has the task queued
    "queued": [("hang",)],
    # head sent, no token yet: prompt processing
    "prompt": [sse_head(), ("hang",)],
    "streaming": STREAMING,
    "parked": [sse_head(), ("send", chunk(0)), ("send", b": preempted\n\n"), ("hang",)],
}
WAIT_FOR = {"queued": None, "prompt": b"\r\n\r\n", "streaming": b"tok3", "parked": b"preempted"}


@pytest.mark.parametrize("phase", list(SCRIPTS))
async def test_disconnect_closes_upstream_fast(
    fake: FakeUpstream, sidecar: Sidecar, phase: str
) -> None:
    fake.route("/v1/chat/completions", SCRIPTS[phase])
    conn = await RawConn.open(sidecar.url)
    seen = fake.request_seen
    await conn.send(REQUEST)
    with anyio.fail_after(5):
        await seen.wait()
    marker = WAIT_FOR[phase]
    if marker is not None:
        await conn.read_until(marker)
    await anyio.sleep(0.2)  # settle in the phase
    closed_at = await conn.close()
    upstream = fake.conns[-1]
    with anyio.fail_after(2):
        await upstream.closed.wait()
    assert upstream.closed_at is not None
    assert upstream.closed_at - closed_at <= 0.1
    with anyio.fail_after(2):
        while sidecar.ctx.active:
            await anyio.sleep(0.01)
    assert sample(sidecar, "client_disconnects_total", phase=phase) == 1
    assert sum(sample(sidecar, "client_disconnects_total", phase=p) for p in SCRIPTS) == 1
    assert sample(sidecar, "streams_active") == 0
    assert sample(sidecar, "streams_parked") == 0
    assert sample(sidecar, "resumes_total") == 0
    assert sample(sidecar, "recomputes_total") == 0
    if phase == "parked":
        assert sample(sidecar, "parks_total") == 1
        assert sample(sidecar, "park_duration_seconds_sum") > 0.1  # ended with the stream


async def test_disconnect_during_upload(fake: FakeUpstream, sidecar: Sidecar) -> None:
    conn = await RawConn.open(sidecar.url)
    await conn.send(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"a" * 1000
    )
    await anyio.sleep(0.3)
    await conn.close()
    with anyio.fail_after(2):
        while sidecar.ctx.active:
            await anyio.sleep(0.01)
    assert sample(sidecar, "client_disconnects_total", phase="request") == 1
    # The body is read in full before upstream is contacted: it never was.
    assert fake.conns == []

"""Finding 4: disconnect detection keeps working whatever the client sends after its request.

The disconnect watcher used to stop reading once 64 KiB had been pipelined after a
request (and sleep for ever), so a client that had sent that much and then left went
unnoticed: llama-server kept generating for nobody.  Now the watcher keeps reading,
dropping what exceeds the bound, and the connection closes after the response.
"""

from __future__ import annotations

import anyio
import pytest

from sidecar.proxy.h11stream import MAX_PIPELINED
from sidecar.proxy.server import Sidecar
from tests.support.fake_upstream import FakeUpstream, chunk, sse_head
from tests.support.rawclient import RawConn
from tests.support.samples import sample

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]

REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b'Content-Length: 16\r\n\r\n{"stream": true}')  # fmt: skip
PIPELINED = {
    "requests": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * (3 * MAX_PIPELINED // 34),
    "garbage": b"x" * (3 * MAX_PIPELINED),
    "one_huge_head": b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * (3 * MAX_PIPELINED),
}


def streaming(n: int, every: float) -> list[tuple[object, ...]]:
    steps: list[tuple[object, ...]] = [sse_head()]
    for i in range(n):
        steps += [("send", chunk(i)), ("sleep", every)]
    return [*steps, ("send", b"data: [DONE]\n\n"), ("end",)]


SCRIPTS = {
    # llama-server has the task queued: nothing is written to the client at all
    "queued": ([("hang",)], None),
    # parked: the client hears only a keepalive a second
    "parked": ([sse_head(), ("send", chunk(0)), ("send", b": preempted\n\n"), ("hang",)],
               b"preempted"),
}  # fmt: skip


@pytest.mark.parametrize("phase", list(SCRIPTS))
@pytest.mark.parametrize("what", list(PIPELINED))
async def test_disconnect_seen_after_a_large_pipelined_tail(
    fake: FakeUpstream, sidecar: Sidecar, what: str, phase: str
) -> None:
    script, marker = SCRIPTS[phase]
    fake.route("/v1/chat/completions", script)
    conn = await RawConn.open(sidecar.url)
    seen = fake.request_seen
    await conn.send(REQUEST + PIPELINED[what])
    with anyio.fail_after(5):
        await seen.wait()
    if marker is not None:
        await conn.read_until(marker)
    await anyio.sleep(0.2)
    closed_at = await conn.close()
    upstream = fake.conns[-1]
    with anyio.fail_after(3):
        await upstream.closed.wait()
    assert upstream.closed_at is not None
    assert upstream.closed_at - closed_at <= 0.1
    with anyio.fail_after(2):
        while sidecar.ctx.active:
            await anyio.sleep(0.01)
    assert sample(sidecar, "client_disconnects_total", phase=phase) == 1


async def test_overflowing_pipeline_gets_its_response_then_a_close(
    fake: FakeUpstream, sidecar: Sidecar
) -> None:
    fake.route("/v1/chat/completions", streaming(20, 0.01))
    async with await RawConn.open(sidecar.url) as conn:
        await conn.send(REQUEST + PIPELINED["requests"])
        resp = await conn.read_response()
        assert resp.status == 200
        assert resp.body.endswith(b"data: [DONE]\n\n")
        assert await conn.wait_closed() == b""  # the dropped requests are not answered


async def test_small_pipeline_still_answered(fake: FakeUpstream, sidecar: Sidecar) -> None:
    fake.route("/v1/chat/completions", streaming(20, 0.01))
    async with await RawConn.open(sidecar.url) as conn:
        await conn.send(REQUEST + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        assert (await conn.read_response()).status == 200
        for _ in range(3):
            assert (await conn.read_response()).status == 200

"""poll_upstream against scripted upstreams (httpx.MockTransport): what one poll makes of them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import httpx
import pytest

from sidecar.core.readiness import MAX_READING_BYTES, PARKED, Readiness, poll_upstream

pytestmark = pytest.mark.anyio

GOOD = f"{PARKED} 0\n".encode()


async def endless() -> AsyncIterator[bytes]:
    while True:
        yield GOOD * 1024
        await anyio.lowlevel.checkpoint()  # so that a test that waits too long can fail


async def one_poll(handler: httpx.MockTransport) -> Readiness:
    readiness = Readiness(0.05)
    async with httpx.AsyncClient(transport=handler) as client, anyio.create_task_group() as tg:
        tg.start_soon(lambda: poll_upstream(readiness, "http://upstream/metrics", client=client))
        with anyio.fail_after(5):
            while readiness.verdict(anyio.current_time()).reason.startswith("no reading"):
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    return readiness


async def test_a_good_reading_is_ready() -> None:
    r = await one_poll(httpx.MockTransport(lambda req: httpx.Response(200, content=GOOD)))
    assert r.verdict(anyio.current_time()).ready


async def test_an_endless_metrics_body_is_a_failed_poll_not_unbounded_memory() -> None:
    """An upstream that answers /metrics with a body without end: the poll stops reading past
    the limit and says why, instead of holding the whole body in memory."""
    r = await one_poll(httpx.MockTransport(lambda req: httpx.Response(200, content=endless())))
    verdict = r.verdict(anyio.current_time())
    assert not verdict.ready
    assert f"over {MAX_READING_BYTES} bytes" in verdict.reason


async def test_an_error_status_is_a_failed_poll() -> None:
    r = await one_poll(httpx.MockTransport(lambda req: httpx.Response(500, content=b"no")))
    verdict = r.verdict(anyio.current_time())
    assert not verdict.ready
    assert "HTTP 500" in verdict.reason

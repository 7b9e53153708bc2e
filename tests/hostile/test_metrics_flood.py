"""A client looping on ``/metrics`` cannot take the event loop from the streams.

Rendering the exposition costs about 1.5 ms of CPU on the loop that relays every stream;
a client asking for it ~400 times a second moved the proxy's median latency from 15 to
329 ms.  Now the sidecar renders at most ``RENDER_RATE`` times a second (after a burst of
``RENDER_BURST``) and answers the requests in between with the last rendering.  The
effect on latency is a benchmark (docs/benchmarks.md, "/metrics flood"); these tests pin
the mechanism: how many renderings a flood gets, and that a scrape is never staler than
``1 / RENDER_RATE`` seconds.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from sidecar.proxy.metrics import RENDER_BURST, RENDER_RATE, RenderLimiter
from sidecar.proxy.server import Sidecar
from tests.support.fake_upstream import FakeUpstream
from tests.support.rawclient import RawConn


def test_the_limiter_renders_a_burst_then_at_its_rate() -> None:
    renders: list[float] = []
    limiter = RenderLimiter(rate=10.0, burst=3)

    def render_at(now: float) -> bytes:
        return limiter.get("text", now, lambda: renders.append(now) or b"%d" % len(renders))

    bodies = [render_at(0.0) for _ in range(10)]
    assert len(renders) == 3  # the burst
    assert bodies[3:] == [b"3"] * 7  # then the last rendering
    render_at(0.05)
    assert len(renders) == 3  # half a token back
    assert render_at(0.1) == b"4"  # a whole one
    assert limiter.get("openmetrics", 0.1, lambda: b"om") == b"om"  # each kind has its own
    render_at(60.0)
    assert [render_at(60.0) for _ in range(3)] == [b"6", b"7", b"7"]  # burst refilled, capped


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_a_metrics_flood_gets_few_renderings(
    fake: FakeUpstream, sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    collects: list[float] = []
    collect = sidecar.registry.collect

    def counted(*args: Any, **kwargs: Any) -> Any:
        collects.append(time.monotonic())
        return collect(*args, **kwargs)

    monkeypatch.setattr(sidecar.registry, "collect", counted)
    assert sidecar.metrics_url is not None
    n = 300
    async with await RawConn.open(sidecar.metrics_url) as c:
        t0 = time.monotonic()
        for _ in range(n):
            await c.send(b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n")
            resp = await c.read_response()
            assert resp.status == 200
            assert b"llama_sidecar_requests_total" in resp.body
        took = time.monotonic() - t0
    # the bound follows from the time the flood took, whatever that was
    assert len(collects) <= RENDER_BURST + RENDER_RATE * took + 1, (len(collects), took)
    assert len(collects) < n


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_a_scrape_is_never_older_than_one_render_interval(
    fake: FakeUpstream, sidecar: Sidecar
) -> None:
    assert sidecar.metrics_url is not None
    async with await RawConn.open(sidecar.metrics_url) as m:
        for _ in range(3 * RENDER_BURST):  # use up the burst: renderings are now rationed
            await m.send(b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n")
            await m.read_response()
        async with await RawConn.open(sidecar.url) as c:
            await c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await c.read_response()).status == 200
        await anyio.sleep(1.5 / RENDER_RATE)
        await m.send(b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n")
        body = (await m.read_response()).body
    assert b'llama_sidecar_requests_total{route="/health",status_class="2xx"} 1.0' in body

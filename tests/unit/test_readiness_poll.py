"""poll_upstream against a scripted upstream on the in-memory net, through the proxy's own
upstream pool: what one poll makes of an answer, and that the polls share the pool."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from sidecar.core.readiness import MAX_READING_BYTES, PARKED, Readiness
from sidecar.proxy.ready_poll import poll_upstream
from sidecar.proxy.upstream import UpstreamPool
from tests.conftest import REPO
from tests.support.fake_upstream import FakeUpstream, Script, json_response
from tests.support.memnet import MemoryNet
from tests.support.sidecar import ephemeral_config

pytestmark = pytest.mark.anyio

GOOD = f"{PARKED} 0\n".encode()


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[FakeUpstream, UpstreamPool]]:
    async with MemoryNet() as net, FakeUpstream(net=net) as fake:
        pool = UpstreamPool(ephemeral_config(fake.url + "/base"), connect=net.connect)
        try:
            yield fake, pool
        finally:
            await pool.aclose()


async def polls(pool: UpstreamPool, readings: int = 1) -> Readiness:
    """Poll until ``readings`` polls have been judged (each one a reading or a failure).

    The poller is stopped from inside the judgement, before it sleeps: no later poll is ever
    cut off mid-request (which would cost the pool its connection, whatever the load)."""
    readiness = Readiness(0.01)
    judged = 0
    observe, failed = readiness.observe, readiness.failed
    async with anyio.create_task_group() as tg:

        def judge() -> None:
            nonlocal judged
            judged += 1
            if judged >= readings:
                tg.cancel_scope.cancel()

        def count_observe(text: str, now: float) -> None:
            observe(text, now)
            judge()

        def count_failed(why: str, now: float) -> None:
            failed(why, now)
            judge()

        readiness.observe, readiness.failed = count_observe, count_failed  # type: ignore[method-assign]
        with anyio.fail_after(5):
            await poll_upstream(readiness, pool)
    assert judged == readings
    return readiness


def metrics(body: bytes) -> Script:
    return [*json_response(200, body, b"text/plain"), ("keep",)]


async def test_a_good_reading_is_ready(upstream: tuple[FakeUpstream, UpstreamPool]) -> None:
    fake, pool = upstream
    fake.route("/base/metrics", metrics(GOOD))
    r = await polls(pool)
    assert r.verdict(anyio.current_time()).ready


async def test_an_endless_metrics_body_is_a_failed_poll_not_unbounded_memory(
    upstream: tuple[FakeUpstream, UpstreamPool],
) -> None:
    """An upstream that answers /metrics with a body without end: the poll stops reading past
    the limit and says why, instead of holding the whole body in memory."""
    fake, pool = upstream
    piece = GOOD * 4096
    fake.route(
        "/base/metrics",
        [("head", 200, []), *[("send", piece)] * (2 * MAX_READING_BYTES // len(piece)), ("hang",)],
    )
    r = await polls(pool)
    verdict = r.verdict(anyio.current_time())
    assert not verdict.ready
    assert f"over {MAX_READING_BYTES} bytes" in verdict.reason


async def test_an_error_status_is_a_failed_poll(
    upstream: tuple[FakeUpstream, UpstreamPool],
) -> None:
    fake, pool = upstream
    fake.route("/base/metrics", json_response(500, b"no", b"text/plain"))
    r = await polls(pool)
    verdict = r.verdict(anyio.current_time())
    assert not verdict.ready
    assert "HTTP 500" in verdict.reason


async def test_polls_share_one_pooled_connection_with_the_proxy(
    upstream: tuple[FakeUpstream, UpstreamPool],
) -> None:
    """The poller is a client of the proxy's upstream pool, not an HTTP client of its own:
    five readings take one keep-alive connection, a relayed request after them reuses it,
    and each poll asks for /metrics under the upstream's base path with a Host."""
    fake, pool = upstream
    fake.route("/base/metrics", metrics(GOOD))
    fake.route("/base/health", metrics(b"ok"))
    r = await polls(pool, readings=5)
    assert r.verdict(anyio.current_time()).ready
    resp = await pool.request(b"GET", b"/health", [(b"Host", b"upstream.test")], None)
    assert await resp.read(16) == b"ok"
    await resp.aclose()
    assert len(fake.conns) == 1
    targets = [req.target for req in fake.requests]
    assert targets[-1] == b"/base/health"
    assert set(targets[:-1]) == {b"/base/metrics"}
    assert len(targets) >= 6
    host = {k.lower(): v for k, v in fake.requests[0].headers}[b"host"]
    assert host == f"{fake.host}:{fake.port}".encode()


def test_the_proxy_path_imports_no_http_client_library() -> None:
    """One HTTP client in the proxy process: the proxy path never imports httpx."""
    import subprocess
    import sys

    code = "import sys, sidecar.proxy.server; print('httpx' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


async def test_an_upstream_that_never_answers_is_a_failed_poll_and_its_connection_is_dropped(
    upstream: tuple[FakeUpstream, UpstreamPool],
) -> None:
    """An upstream that takes the /metrics request and never answers: the poll gives up after
    its bound and says so, and the hung connection is closed, not pooled, so the next poll and
    the relayed requests do not queue behind it."""
    fake, pool = upstream
    fake.route("/base/metrics", [("hang",)])
    r = await polls(pool)
    verdict = r.verdict(anyio.current_time())
    assert not verdict.ready
    assert "timed out" in verdict.reason
    fake.route("/base/metrics", metrics(GOOD))
    r = await polls(pool)
    assert r.verdict(anyio.current_time()).ready
    # the good reading came on a fresh connection; each hung one was closed by the pool
    hung, good = fake.conns[:-1], fake.conns[-1]
    assert hung
    assert all(c.closed_at is not None for c in hung), hung
    assert good.closed_at is None

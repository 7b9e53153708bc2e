"""``/ready`` on the metrics listener follows llama-server's parked-request gauge."""

from __future__ import annotations

import anyio
import httpx
import pytest

from sidecar.core.readiness import PARKED
from tests.support.fake_upstream import FakeUpstream, chunk, park_script, sse_head
from tests.support.fixtures import SidecarFactory

pytestmark = pytest.mark.anyio

POLL = 0.1


def metrics_script(parked: int) -> list[tuple[object, ...]]:
    body = f"# TYPE {PARKED} gauge\n{PARKED} {parked}\nllamacpp:requests_processing 1\n"
    return [("head", 200, [(b"Content-Type", b"text/plain")]), ("send", body.encode()), ("end",)]


async def ready_status(client: httpx.AsyncClient, url: str) -> tuple[int, str]:
    r = await client.get(url)
    return r.status_code, r.text


async def wait_status(
    client: httpx.AsyncClient, url: str, want: int, containing: str = "", timeout: float = 5.0
) -> str:
    """Poll ``url`` until it answers ``want`` with ``containing`` in the body; the body."""
    with anyio.fail_after(timeout):
        while True:
            status, body = await ready_status(client, url)
            if status == want and containing in body:
                return body
            await anyio.sleep(POLL / 4)


async def test_ready_flips_with_parked_requests(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/metrics", metrics_script(0))
    fake.route("/v1/chat/completions", park_script(before=2, park=1.0, after=2))
    async with sidecar_factory(fake.url, ready_poll=POLL) as sc, httpx.AsyncClient() as c:
        assert sc.metrics_url is not None
        ready_url = sc.metrics_url.replace("/metrics", "/ready")
        await wait_status(c, ready_url, 200, "no parked requests")
        assert "llama_sidecar_ready 1.0" in (await c.get(sc.metrics_url)).text

        # a stream is running through the sidecar while the server starts to park
        async def stream() -> str:
            async with httpx.AsyncClient(timeout=30) as s:
                r = await s.post(sc.url + "/v1/chat/completions", json={"stream": True})
                return r.text

        result: list[str] = []

        async def collect() -> None:
            result.append(await stream())

        async with anyio.create_task_group() as tg:
            tg.start_soon(collect)
            fake.route("/metrics", metrics_script(2))
            await wait_status(c, ready_url, 503, "2 request(s) parked")
            assert "llama_sidecar_ready 0.0" in (await c.get(sc.metrics_url)).text
            fake.route("/metrics", metrics_script(0))
            await wait_status(c, ready_url, 200)
        # the running stream was never touched by readiness
        assert chunk(3).decode() in result[0]
        assert "[DONE]" in result[0]
        assert sc.readiness.flips >= 2


async def test_not_ready_while_upstream_metrics_fail_or_are_missing(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/metrics", [("head", 500, []), ("end",)])
    async with sidecar_factory(fake.url, ready_poll=POLL) as sc, httpx.AsyncClient() as c:
        assert sc.metrics_url is not None
        ready_url = sc.metrics_url.replace("/metrics", "/ready")
        await wait_status(c, ready_url, 503, "HTTP 500")
        # HEAD works as for the other endpoints; /healthz stays 200 (the process is alive)
        assert (await c.head(ready_url)).status_code == 503
        assert (await c.get(sc.metrics_url.replace("/metrics", "/healthz"))).status_code == 200
        fake.route("/metrics", [sse_head(), ("send", b"no gauges here\n"), ("end",)])
        await wait_status(c, ready_url, 503, "not the patched server")


async def test_not_ready_when_upstream_is_gone(sidecar_factory: SidecarFactory) -> None:
    async with (
        sidecar_factory("http://127.0.0.1:9", ready_poll=POLL) as sc,
        httpx.AsyncClient() as c,
    ):
        assert sc.metrics_url is not None
        await wait_status(c, sc.metrics_url.replace("/metrics", "/ready"), 503, "did not answer")

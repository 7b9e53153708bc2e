"""Metrics after scripted scenarios, the exposition format, bounded labels."""

from __future__ import annotations

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.proxy.metrics import KNOWN_ROUTES
from sidecar.proxy.server import Sidecar
from tests.support.fake_upstream import FakeUpstream, chunk, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.memnet import http_client

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(sc: Sidecar) -> Samples:
    assert sc.metrics_url is not None
    async with http_client() as c:
        r = await c.get(sc.metrics_url)
        health = await c.get(sc.metrics_url.replace("/metrics", "/healthz"))
    assert r.status_code == 200
    assert health.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def v(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def test_metrics_after_scripted_scenarios(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/v1/chat/completions", [
        sse_head(), ("send", chunk(0)), ("send", b": preempted\n\n"), ("sleep", 1.5),
        ("send", b": resumed\n\n"), ("send", chunk(1)),
        ("send", b": preempted\n\n"), ("sleep", 0.2),
        ("send", b": recomputed\n\n"), ("send", chunk(2)), ("end",)])  # fmt: skip
    fake.route("/completion", [sse_head(), ("send", chunk(0)), ("send", b":\n\n"),
                               ("send", chunk(1)), ("end",)])  # fmt: skip
    fake.route("/props", [("head", 200, [(b"Content-Length", b"2")]), ("send", b"{}"), ("end",)])
    fake.route("/v1/models", [("head", 404, [(b"Content-Length", b"0")]), ("end",)])
    fake.route("/infill", [sse_head(), ("send", chunk(0)), ("sleep", 0.05), ("die",)])
    async with sidecar_factory(fake.url) as sc, http_client(timeout=10) as c:
        before = await scrape(sc)
        assert v(before, "llama_sidecar_parks_total") == 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(c.post, sc.url + "/v1/chat/completions")
            tg.start_soon(c.post, sc.url + "/completion")
            tg.start_soon(c.get, sc.url + "/props")
            tg.start_soon(c.get, sc.url + "/v1/models")
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(sc.url + "/infill")
        with anyio.fail_after(2):
            while sc.ctx.active:
                await anyio.sleep(0.01)
        m = await scrape(sc)

    chat = len(chunk(0)) * 3 + len(b": preempted\n\n: resumed\n\n: preempted\n\n: recomputed\n\n")
    assert v(m, "llama_sidecar_parks_total") == 2
    assert v(m, "llama_sidecar_resumes_total") == 1
    assert v(m, "llama_sidecar_recomputes_total") == 1
    assert v(m, "llama_sidecar_park_duration_seconds_count") == 2
    assert 1.6 <= v(m, "llama_sidecar_park_duration_seconds_sum") <= 2.5
    assert v(m, "llama_sidecar_park_duration_seconds_bucket", le="3600.0") == 2
    assert v(m, "llama_sidecar_upstream_comments_total", kind="preempted") == 2
    assert v(m, "llama_sidecar_upstream_comments_total", kind="resumed") == 1
    assert v(m, "llama_sidecar_upstream_comments_total", kind="recomputed") == 1
    assert v(m, "llama_sidecar_upstream_comments_total", kind="ping") == 1
    assert v(m, "llama_sidecar_upstream_comments_total", kind="other") == 0
    assert v(m, "llama_sidecar_keepalives_total", reason="park") == 1
    assert v(m, "llama_sidecar_keepalives_total", reason="idle") == 0
    assert v(m, "llama_sidecar_streams_active") == 0
    assert v(m, "llama_sidecar_streams_parked") == 0
    assert (
        v(m, "llama_sidecar_requests_total", route="/v1/chat/completions", status_class="2xx") == 1
    )
    assert v(m, "llama_sidecar_requests_total", route="/completion", status_class="2xx") == 1
    assert v(m, "llama_sidecar_requests_total", route="/props", status_class="2xx") == 1
    assert v(m, "llama_sidecar_requests_total", route="/v1/models", status_class="4xx") == 1
    assert v(m, "llama_sidecar_requests_total", route="/infill", status_class="2xx") == 1
    assert v(m, "llama_sidecar_request_duration_seconds_count", route="/v1/chat/completions") == 1
    assert v(m, "llama_sidecar_time_to_first_byte_seconds_count", route="/props") == 1
    assert v(m, "llama_sidecar_stream_longest_silence_seconds_count") == 3
    assert v(m, "llama_sidecar_upstream_errors_total", kind="disconnect") == 1
    assert v(m, "llama_sidecar_upstream_errors_total", kind="connect") == 0
    assert sum(v(m, "llama_sidecar_client_disconnects_total", phase=p)
               for p in ("request", "queued", "prompt", "streaming", "parked")) == 0  # fmt: skip
    assert v(m, "llama_sidecar_upstream_up") == 1
    expected_bytes = chat + len(chunk(0)) * 2 + 3 + 2 + len(chunk(0))
    assert v(m, "llama_sidecar_bytes_total", direction="response") == expected_bytes
    assert v(m, "llama_sidecar_bytes_total", direction="request") == 0
    info = [k for k in m if k[0] == "llama_sidecar_build_info"]
    assert len(info) == 1
    assert ("version", "0.1.0") in info[0][1]
    # longest silence: the 1.5 s park had one keepalive at 1 s, then 0.5 s more
    assert 0.95 <= v(m, "llama_sidecar_stream_longest_silence_seconds_sum") - 0 <= 3


async def test_upstream_down_metrics(sidecar_factory: SidecarFactory) -> None:
    async with sidecar_factory("http://127.0.0.1:1") as sc, http_client() as c:
        assert (await c.get(sc.url + "/health")).status_code == 502
        m = await scrape(sc)
    assert v(m, "llama_sidecar_upstream_up") == 0
    assert v(m, "llama_sidecar_upstream_errors_total", kind="connect") == 1
    assert v(m, "llama_sidecar_requests_total", route="/health", status_class="5xx") == 1


async def test_labels_bounded_under_many_paths(fake: FakeUpstream, sidecar: Sidecar) -> None:
    # 300 distinct paths: a route label per path would give each of them a request counter and
    # two histograms (thousands of samples against the bound of 400 below)
    async with http_client() as c:
        for i in range(300):
            r = await c.get(f"{sidecar.url}/x/{i}/{'y' * (i % 7)}?id={i}")
            assert r.status_code == 200
        await c.get(sidecar.url + "/slots/3?action=save")
    m = await scrape(sidecar)
    routes = {dict(labels).get("route") for (name, labels) in m if "route" in dict(labels)}
    assert routes <= KNOWN_ROUTES | {"other"}
    assert v(m, "llama_sidecar_requests_total", route="other", status_class="2xx") == 300
    assert v(m, "llama_sidecar_requests_total", route="/slots", status_class="2xx") == 1
    assert len(m) < 400


async def test_metrics_listener_404_and_openmetrics(sidecar: Sidecar) -> None:
    assert sidecar.metrics_url is not None
    async with http_client() as c:
        r = await c.get(sidecar.metrics_url.replace("/metrics", "/nope"))
        assert r.status_code == 404
        r = await c.get(sidecar.metrics_url, headers={"Accept": "application/openmetrics-text"})
        assert r.headers["content-type"].startswith("application/openmetrics-text")
        assert r.text.rstrip().endswith("# EOF")

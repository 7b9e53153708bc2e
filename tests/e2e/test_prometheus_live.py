"""A real Prometheus, configured from grafana/prometheus.yml, scrapes a live `up` through
an overload run: every PromQL expression of grafana/dashboard.json evaluates without
error through the HTTP API, and the park, resume and parked-RAM series have data."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import OVERFLOW_ARGS, RunUp
from tests.e2e.test_prometheus_fake import SCRAPE_INTERVAL, SHORT_METRICS_TIMEOUTS
from tests.support.prometheus import (
    PROMETHEUS,
    Prometheus,
    assert_every_scrape_succeeded,
    dashboard,
    dashboard_queries,
    metric_names,
    scrape_config,
)
from tests.support.sse_client import StreamLog, stream_sse

# A 1 s scrape must land inside a park. The park lasts the rest of the other stream, counted in
# the model's steps (about 90 when both start together, some seconds), so a busier machine only
# makes it longer; the streams would have to start seconds apart for it to fall under a second.
pytestmark = [
    pytest.mark.server,
    pytest.mark.slow,
    pytest.mark.prometheus,
    # its two streams must overlap for seconds: beside two other workers at a cold start no
    # scrape saw parked RAM once (3 Dec 2026)
    pytest.mark.serial,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed"),
]

TOKENS = 220
PARK_SERIES = ("llamacpp:n_preempt_total", "llamacpp:n_resume_total",
               "llamacpp:preempt_ram_bytes", "llama_sidecar_parks_total",
               "llama_sidecar_resumes_total")  # fmt: skip


def overload(url: str) -> list[StreamLog]:
    body = {"prompt": "Once upon a time", "n_predict": TOKENS, "ignore_eos": True,
            "stream": True}  # fmt: skip
    logs: list[StreamLog] = []
    threads = [threading.Thread(target=lambda: logs.append(stream_sse(url, body, timeout=600)))
               for _ in range(2)]  # fmt: skip
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    return logs


def test_dashboard_queries_against_a_live_overloaded_pair(
    run_preempting_up: RunUp, slow_model: Path, tmp_path: Path
) -> None:
    # The slow model makes parks last seconds, so a 1 s scrape sees parked RAM > 0.  The
    # interval is longer than every idle timeout of the sidecar's metrics listener, so
    # each scrape finds its kept-alive connection closed.
    up = run_preempting_up("--model", str(slow_model), *OVERFLOW_ARGS, "--", "-t", "1",
                           env=SHORT_METRICS_TIMEOUTS)  # fmt: skip
    config = scrape_config(f"127.0.0.1:{up.metrics_port}", f"127.0.0.1:{up.server_port}",
                           interval=SCRAPE_INTERVAL)  # fmt: skip
    prom = Prometheus(tmp_path / "prom", config).start()
    try:
        prom.wait_scraping()
        logs = overload(up.url + "/completion")
        ended = time.time()
        assert all(log.done or (log.final() or {}).get("stop") for log in logs)
        # Both jobs scraped after the run: their counters are final in Prometheus.
        prom.wait_for("llamacpp:n_resume_total > 0")
        for job in ("llama-server", "llama-sidecar"):
            prom.wait_for(f'timestamp(up{{job="{job}"}}) > {ended:.3f}', 30)

        for name in PARK_SERIES:
            assert prom.wait_for(name), name
        parks = prom.wait_for("max_over_time(llamacpp:n_preempt_total[5m])")
        assert float(parks[0]["value"][1]) >= 1
        resumes = prom.wait_for("max_over_time(llamacpp:n_resume_total[5m])")
        assert float(resumes[0]["value"][1]) >= 1
        # The sidecar saw the same parks on the streams (': preempted' notices).
        sidecar_parks = prom.wait_for("max_over_time(llama_sidecar_parks_total[5m])")
        assert float(sidecar_parks[0]["value"][1]) == float(parks[0]["value"][1])
        ram = prom.wait_for("max_over_time(llamacpp:preempt_ram_bytes[5m])")
        assert float(ram[0]["value"][1]) > 0, "no scrape saw parked RAM"

        errors, empty = [], []
        for title, expr in dashboard_queries(dashboard()):
            ans = prom.query(expr)
            if ans["status"] != "success":
                errors.append(f"{title}: {expr} -> {ans.get('error')}")
            elif not ans["data"]["result"] and metric_names(expr) & set(PARK_SERIES):
                empty.append(f"{title}: {expr}")
        assert not errors, "\n".join(errors)
        assert not empty, "park/resume/RAM panels without data:\n" + "\n".join(empty)
        assert_every_scrape_succeeded(prom)
    finally:
        prom.stop()

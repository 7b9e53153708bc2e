"""Prometheus from grafana/prometheus.yml scraping `up` with a stand-in llama-server that
parks every stream for 2 s: the dashboard's PromQL evaluates on live data and the park
panels have data. Runs without the C++ build; test_prometheus_live.py is the real thing.

The scrape interval is longer than every idle timeout of the sidecar's metrics listener
(given to the sidecar through `up`'s environment), so every scrape finds its kept-alive
connection closed, as Prometheus's default 1 m interval does against the default 75 s
keep-alive timeout when a scrape is late: each scrape must still succeed (the metrics
listener's 30 s trap)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.support.prometheus import (
    PROMETHEUS,
    Prometheus,
    assert_every_scrape_succeeded,
    dashboard,
    dashboard_queries,
    scrape_config,
)
from tests.support.sse_client import StreamLog, stream_sse
from tests.support.up import UpProcess

# Longer than the idle timeouts the sidecar gets here (keep-alive idle, first byte).
SCRAPE_INTERVAL = "1s"
SHORT_METRICS_TIMEOUTS = {"LLAMA_SIDECAR_KEEPALIVE_TIMEOUT": "0.4",
                          "LLAMA_SIDECAR_HEADER_TIMEOUT": "0.4"}  # fmt: skip

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed"),
]


def test_dashboard_queries_on_live_data_from_a_parking_stand_in(tmp_path: Path,
                                                              fake_server_bin: Path) -> None:
    model = tmp_path / "fake.gguf"
    model.write_bytes(b"GGUF")
    up = UpProcess(["--server-bin", str(fake_server_bin), "--model", str(model)], tmp_path,
                   env={"FAKE_PARK_S": "2", **SHORT_METRICS_TIMEOUTS})  # fmt: skip
    prom = None
    try:
        up.start(timeout=60)
        config = scrape_config(f"127.0.0.1:{up.metrics_port}", f"127.0.0.1:{up.server_port}",
                               interval=SCRAPE_INTERVAL)  # fmt: skip
        prom = Prometheus(tmp_path / "prom", config).start()
        prom.wait_scraping()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                "stream": True}  # fmt: skip
        logs: list[StreamLog] = []
        url = up.url + "/v1/chat/completions"
        threads = [threading.Thread(target=lambda: logs.append(stream_sse(url, body)))
                   for _ in range(2)]  # fmt: skip
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert len(logs) == 2
        assert all(log.done for log in logs)
        prom.wait_for("max_over_time(llamacpp:preempt_ram_bytes[5m]) > 0", 30)
        prom.wait_for("llama_sidecar_resumes_total >= 2", 30)
        errors, empty = [], []
        for title, expr in dashboard_queries(dashboard()):
            ans = prom.query(expr)
            if ans["status"] != "success":
                errors.append(f"{title}: {expr} -> {ans.get('error')}")
            elif not ans["data"]["result"] and ("park" in title.lower() or "RAM" in title):
                empty.append(f"{title}: {expr}")
        assert not errors, "\n".join(errors)
        assert not empty, "\n".join(empty)
        assert_every_scrape_succeeded(prom)
    finally:
        if prom is not None:
            prom.stop()
        up.kill()

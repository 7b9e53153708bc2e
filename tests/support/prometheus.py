"""Run a real Prometheus (and promtool) for a test; substitute Grafana variables in PromQL."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.procs import ManagedProcess, Service, file_tail, free_port, http_ok

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "grafana"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

# What Grafana puts in place of its variables when it sends a query.
GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$sidecar": ".*",
    "$server": ".*",
    "$proxy_timeout": "60",
}


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((GRAFANA / "dashboard.json").read_text())
    return doc


def panels(doc: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for p in doc["panels"]:
        yield p
        yield from p.get("panels", [])  # collapsed rows keep their panels inside


def dashboard_queries(doc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL with the Grafana variables substituted) for every target."""
    out = []
    for p in panels(doc):
        for t in p.get("targets", []):
            expr = t["expr"]
            for var in sorted(GRAFANA_VARS, key=len, reverse=True):
                expr = expr.replace(var, GRAFANA_VARS[var])
            assert "$" not in expr, f"unsubstituted variable in {p['title']!r}: {expr}"
            out.append((p["title"], expr))
    return out


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(llama_sidecar_\w+|llamacpp:\w+)", expr))


@dataclass
class Prometheus(Service):
    tmp: Path
    config: str
    port: int = 0
    process: ManagedProcess | None = None
    # one connection for the queries: a client per query made a dashboard's 37 take seconds
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30.0), repr=False)

    def start(self, timeout: float = 60.0) -> Prometheus:
        assert PROMETHEUS is not None
        self.port = self.port or free_port()
        self.tmp.mkdir(parents=True, exist_ok=True)
        cfg = self.tmp / "prometheus.yml"
        cfg.write_text(self.config)
        self.process = ManagedProcess(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={self.tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle",
             # the scrape manager takes new targets at most every 5 s by default: the first
             # scrape of a test would wait for that
             "--scrape.discovery-reload-interval=100ms"],
            "prometheus", log_path=self.tmp / "prometheus.log",
            ready=http_ok(self.url + "/-/ready"), stop_timeout=20.0, poll_every=0.2,
        )  # fmt: skip
        self.process.start(timeout)
        return self

    def stop(self) -> int | None:
        self.http.close()
        return super().stop()

    def log(self) -> str:
        return file_tail(self.tmp / "prometheus.log")

    def query(self, expr: str) -> dict[str, Any]:
        """The raw API answer (status, data or errorType/error) of an instant query."""
        r = self.http.get(self.url + "/api/v1/query", params={"query": expr})
        doc: dict[str, Any] = r.json()
        return doc

    def wait_for(self, expr: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Poll an instant query until it returns data (a valid query is asserted)."""
        deadline = time.monotonic() + timeout
        while True:
            ans = self.query(expr)
            assert ans["status"] == "success", ans
            if ans["data"]["result"]:
                return list(ans["data"]["result"])
            assert time.monotonic() < deadline, f"no data for {expr} in {timeout}s"
            time.sleep(0.2)

    def wait_scraping(self, timeout: float = 60.0) -> None:
        """Both jobs scraped successfully."""
        self.wait_for('up{job="llama-server"} == 1', timeout)
        self.wait_for('up{job="llama-sidecar"} == 1', timeout)


def assert_every_scrape_succeeded(prom: Prometheus, window: str = "30s", at_least: int = 5) -> None:
    """The sidecar's metrics listener answered every scrape of the last ``window``.

    ``up`` is 0 for a failed scrape; a listener that closed a kept-alive connection
    at the wrong moment (or died) shows up here.
    """
    time.sleep(2)  # a few more scrapes, on connections the sidecar closed meanwhile
    job = 'up{job="llama-sidecar"}'
    count = prom.wait_for(f"count_over_time({job}[{window}])")
    assert float(count[0]["value"][1]) >= at_least, count
    worst = prom.wait_for(f"min_over_time({job}[{window}])")
    assert float(worst[0]["value"][1]) == 1.0, f"a scrape of the sidecar failed: {worst}"


def scrape_config(sidecar_metrics: str, server: str, interval: str = "1s") -> str:
    """grafana/prometheus.yml with the targets and intervals of a test run."""
    text = (GRAFANA / "prometheus.yml").read_text()
    text = text.replace('"127.0.0.1:9464"', f'"{sidecar_metrics}"')
    text = text.replace('"127.0.0.1:8080"', f'"{server}"')
    text = re.sub(r"(scrape|evaluation)_interval: \S+", rf"\1_interval: {interval}", text)
    text = text.replace("  - alerts.yml", f"  - {GRAFANA / 'alerts.yml'}")
    assert sidecar_metrics in text
    assert server in text
    return text

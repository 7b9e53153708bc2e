"""grafana/: the scrape config and alert rules pass promtool (including the rule unit
tests), and every PromQL expression of the dashboard parses and evaluates in a real
Prometheus. test_prometheus_live.py checks the same expressions against live data."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.prometheus import (
    GRAFANA,
    PROMETHEUS,
    PROMTOOL,
    Prometheus,
    dashboard,
    dashboard_queries,
    panels,
)

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (apt-get install prometheus)"
)


def promtool(*args: str) -> str:
    assert PROMTOOL is not None
    r = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=GRAFANA)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


@pytest.mark.prometheus
@needs_promtool
def test_promtool_check_config() -> None:
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")


@pytest.mark.prometheus
@needs_promtool
def test_promtool_check_rules() -> None:
    assert "SUCCESS" in promtool("check", "rules", "alerts.yml")


@pytest.mark.prometheus
@needs_promtool
def test_promtool_rule_tests_pass_and_cover_every_alert() -> None:
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")
    rules = alert_names(GRAFANA / "alerts.yml")
    assert len(rules) >= 5
    assert alert_names(GRAFANA / "alerts_test.yml") == rules


def alert_names(path: Path) -> set[str]:
    """Alert names in a rules or rule-test file (a line scan: no YAML dependency)."""
    names = set()
    for line in path.read_text().splitlines():
        s = line.strip()
        for key in ("- alert:", "alertname:"):
            if s.startswith(key):
                names.add(s.removeprefix(key).strip())
    return names


def test_dashboard_shape() -> None:
    doc = dashboard()
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids))
    for p in panels(doc):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    # Panels must not overlap on the grid.
    cells: set[tuple[int, int]] = set()
    for p in panels(doc):
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"{p['title']} overlaps another panel"
        assert g["x"] + g["w"] <= 24
        cells |= mine
    titles = " ".join(p["title"] for p in panels(doc)).lower()
    for needed in (
        "active and parked",
        "park and resume",
        "park duration",
        "keepalives",
        "silence",
        "status",
        "first byte",
        "kv",
        "parked requests",
        "parked ram",
    ):
        assert needed in titles, needed


@pytest.fixture
def empty_prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path / "prom", "global:\n  scrape_interval: 15s\n").start()
    try:
        yield prom
    finally:
        prom.stop()


@pytest.mark.prometheus
@needs_prometheus
def test_every_dashboard_query_is_valid_promql(empty_prometheus: Prometheus) -> None:
    bad = []
    for title, expr in dashboard_queries(dashboard()):
        answer = empty_prometheus.query(expr)
        if answer["status"] != "success":
            bad.append(f"{title}: {expr}\n  -> {answer.get('error')}")
    assert not bad, "\n".join(bad)

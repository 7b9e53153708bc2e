"""`llama-sidecar probe` as a subprocess through `up` with a stand-in server that parks
every stream once: the JSON summary counts the notices the server sent, the plot is a PNG,
and Ctrl-C prints what arrived so far. test_probe.py does it with the real server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.llama import parse_metrics
from tests.support.up import UpProcess

PROBE = [sys.executable, "-c", "from sidecar.cli import main; main()", "probe"]


def parking_up(tmp_path: Path, server_bin: Path, park_s: float) -> UpProcess:
    model = tmp_path / "fake.gguf"
    model.write_bytes(b"GGUF")
    up = UpProcess(["--server-bin", str(server_bin), "--model", str(model), "--drain-timeout", "1"],
                   tmp_path, env={"FAKE_PARK_S": str(park_s)})  # fmt: skip
    return up.start(timeout=60)


@pytest.fixture(scope="module")
def parking_ups(tmp_path_factory: pytest.TempPathFactory,
                fake_server_bin: Path) -> Iterator[dict[str, UpProcess]]:  # fmt: skip
    """The module's two stand-ins, started at once: one parks 1.2 s, one for good (60 s)."""
    tmp = tmp_path_factory.mktemp("probe-fake")
    parks = {"1s": 1.2, "forever": 60.0}
    for name in parks:
        (tmp / name).mkdir()
    with ThreadPoolExecutor(len(parks)) as pool:
        futures = {name: pool.submit(parking_up, tmp / name, fake_server_bin, park)
                   for name, park in parks.items()}  # fmt: skip
    ups = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for future in futures.values():
            future.result()  # a stand-in that did not start fails the tests
        yield ups
    finally:
        for up in ups.values():
            up.kill()


@pytest.fixture
def up_parking_1s(parking_ups: dict[str, UpProcess]) -> UpProcess:
    return parking_ups["1s"]


def test_probe_json_counts_what_the_server_sent_and_plots(
    up_parking_1s: UpProcess, tmp_path: Path
) -> None:
    png = tmp_path / "probe.png"
    cmd = [*PROBE, up_parking_1s.url, "-n", "3", "-t", "8", "--json", "--plot", str(png)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    t = doc["totals"]
    assert (t["streams"], t["done"], t["tokens"]) == (3, 3, 24)
    assert (t["parks"], t["resumes"]) == (3, 3)
    assert t["keepalives"] >= 3 * 2  # the stand-in sends one every 0.5 s while parked
    for s in doc["streams"]:
        assert len(s["park_spans"]) == 1
        assert s["parked_s"] >= 1.0
        assert s["lines"][0]["text"].startswith("data: ")
    server = parse_metrics(httpx.get(up_parking_1s.server_url + "/metrics", timeout=10).text)
    assert server["n_preempt_total"] == t["parks"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_prints_the_partial_summary(parking_ups: dict[str, UpProcess]) -> None:
    up = parking_ups["forever"]
    proc = subprocess.Popen([*PROBE, up.url, "-n", "2", "-t", "6"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while sum(": preempted" in ln for ln in seen) < 2:
        assert time.monotonic() < deadline, "".join(seen)
        seen.append(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, "".join(seen) + out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("#")]
    assert [r[2] for r in rows[:2]] == ["error", "error"]
    assert "#0: interrupted" in out
    assert out.strip().splitlines()[-3].startswith("total")

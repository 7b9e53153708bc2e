"""`llama-sidecar probe` through `up` on an overflowing pair: the parks it reports are the
parks llama-server counted, and --plot draws them.

The tiny model's streams last a fraction of a second, so whether two of them overlap enough to
overflow the pool depends on how soon the second one starts (on a busy machine it once started
after the first had ended). The server also parks every generating slot each EVERY tokens
(`LLAMA_SERVER_PREEMPT_EVERY`): every run has parks to count, whatever the timing, and the
overflow's own parks, when the streams overlap, are counted with them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import OVERFLOW_ARGS
from tests.support.llama import parse_metrics
from tests.support.up import UpProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]

TOKENS = 160
EVERY = 50


def server_counters(url: str) -> tuple[float, float]:
    m = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
    return m["n_preempt_total"], m["n_resume_total"]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, preempting_server_bin: Path,
       tiny_model: Path) -> Iterator[UpProcess]:  # fmt: skip
    """One overflowing pair for both tests: each counts what its own probe run added."""
    tmp = tmp_path_factory.mktemp("probe-up")
    up = UpProcess(["--server-bin", str(preempting_server_bin), "--model", str(tiny_model),
                    *OVERFLOW_ARGS, "--", "-t", "1", "--preempt-test-knobs"], tmp,
                   env={"LLAMA_SERVER_PREEMPT_EVERY": str(EVERY)})  # fmt: skip
    try:
        yield up.start(timeout=240)
    finally:
        up.kill()


def sidecar_counters(up: UpProcess) -> dict[str, float]:
    return parse_metrics(httpx.get(up.metrics_url, timeout=30).text, prefix="llama_sidecar_")


def test_probe_reports_the_parks_the_server_reports(up: UpProcess, tmp_path: Path) -> None:
    parks0, resumes0 = server_counters(up.server_url)
    sidecar0 = sidecar_counters(up)
    png = tmp_path / "probe.png"
    cmd = [sys.executable, "-c", "from sidecar.cli import main; main()", "probe", up.url,
           "--streams", "2", "--max-tokens", str(TOKENS), "--json", "--plot", str(png)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(r.stdout)
    parks1, resumes1 = server_counters(up.server_url)

    totals = doc["totals"]
    assert totals["done"] == 2
    assert all(s["tokens"] == TOKENS for s in doc["streams"]), [s["tokens"] for s in doc["streams"]]
    # the forced parks at least: each stream's every EVERY tokens (the last may fall past its end)
    assert parks1 - parks0 >= 2 * (TOKENS // EVERY - 1), "nothing was parked"
    assert totals["parks"] >= 1, (
        f"llama-server parked {parks1 - parks0:g} time(s) but no stream carried a "
        "': preempted' notice: the stream-notices patch is not in this build"
    )
    assert totals["parks"] == parks1 - parks0
    assert totals["resumes"] == resumes1 - resumes0
    # The sidecar counted the same parks.
    sidecar = sidecar_counters(up)
    sidecar_parks = sidecar["parks_total"] - sidecar0["parks_total"]
    sidecar_resumes = sidecar["resumes_total"] - sidecar0["resumes_total"]
    assert sidecar_parks == totals["parks"] == parks1 - parks0
    assert sidecar_resumes == totals["resumes"] == resumes1 - resumes0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_probe_prints_a_timeline_and_a_table(up: UpProcess) -> None:
    cmd = [sys.executable, "-c", "from sidecar.cli import main; main()", "probe", up.url,
           "-n", "2", "-t", str(TOKENS)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any(": preempted" in ln and "#" in ln for ln in lines), (
        "no ': preempted' line (is the stream-notices patch in this build?)\n"
        + r.stdout[-3000:]
    )
    assert any(ln.startswith("total") and "2/2 done" in ln for ln in lines)

"""The UI patch's own unit tests (Vitest, the UI's unit project), run where build_llama.sh
built the web UI: the patched tools/ui sources with the node_modules of the shipped lock file.
They cover the SSE notice parser and the chat service's pause reports; a pristine UI fails
them (no parser, no onPause)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from sidecar.paths import cache_dir

pytestmark = pytest.mark.slow

UI_TESTS = ["tests/unit/stream-notices.test.ts"]


def test_vitest_stream_notices() -> None:
    if shutil.which("node") is None or shutil.which("npx") is None:
        pytest.skip("node/npm are not installed (apt-get install nodejs npm)")
    work = cache_dir() / "ui" / "work"
    if not (work / "node_modules" / ".bin" / "vitest").exists():
        pytest.skip(f"the web UI has not been built in {work} yet (./build_llama.sh builds it)")
    missing = [t for t in UI_TESTS if not (work / t).exists()]
    assert not missing, f"{work} holds a UI without the series' UI patch: {missing}"
    proc = subprocess.run(["npx", "vitest", "--project=unit", "--run", *UI_TESTS], cwd=work,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "failed" not in out.split("Test Files")[-1], out[-2000:]

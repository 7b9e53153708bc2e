"""The tooling configured in pyproject.toml passes: ruff everywhere, mypy --strict on sidecar/."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, capture_output=True, text=True)


def test_ruff_is_clean() -> None:
    proc = run("ruff", "check", "sidecar", "tests", "benchmarks")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_is_clean() -> None:
    proc = run("mypy", "sidecar")
    assert proc.returncode == 0, proc.stdout + proc.stderr

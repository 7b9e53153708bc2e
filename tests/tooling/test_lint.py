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


def ruff_on(path: str, source: str) -> subprocess.CompletedProcess[str]:
    """ruff on ``source`` as if it were the file ``path`` (nothing is written)."""
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "TID", "--stdin-filename", path, "-"],
        cwd=REPO, input=source, capture_output=True, text=True,
    )  # fmt: skip


def test_the_no_io_rule_covers_every_module_in_the_core_folder() -> None:
    """The rule is by folder: a new module in sidecar/core/ is banned I/O without a list to
    extend, the proxy path is not, and only errors.py in the core may import anyio."""
    for source, rule in [("import socket\n", "TID251"), ("import anyio\n", "TID253")]:
        core = ruff_on("sidecar/core/new_module.py", source)
        assert core.returncode == 1
        assert rule in core.stdout
        assert ruff_on("sidecar/proxy/new_module.py", source).returncode == 0
    assert ruff_on("sidecar/core/errors.py", "import anyio\n").returncode == 0
    assert ruff_on("sidecar/core/errors.py", "import socket\n").returncode == 1

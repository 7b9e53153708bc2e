"""Fixtures for the end-to-end tests: `up` as an operator runs it, with the real binary."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sidecar.ops.supervise import server_supports
from tests.support import fake_upstream
from tests.support.up import UpProcess

RunUp = Callable[..., UpProcess]

# Two streams that cannot fit the 256-cell pool together.
OVERFLOW_ARGS = ("--parallel", "2", "--ctx-size", "256", "--preempt-ram", "8192")


@pytest.fixture(scope="session")
def fake_server_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An executable stand-in for llama-server (:mod:`tests.support.fake_upstream`)."""
    return fake_upstream.fake_server_bin(tmp_path_factory.mktemp("fake-llama-server"))


@pytest.fixture(scope="session")
def preempting_server_bin(llama_server_bin: Path) -> Path:
    """The patched binary, which must have KV preemption (`--preempt-ram`).

    Fails rather than skips: these tests exist to show parking end to end, and a build
    without it would make them pass vacuously or not at all.
    """
    if not server_supports(llama_server_bin, "--preempt-ram"):
        pytest.fail(
            f"{llama_server_bin} has no --preempt-ram: the KV preemption patches "
            "is not in server_patch/series yet, or the binary is stale (./build_llama.sh)"
        )
    return llama_server_bin


@pytest.fixture
def run_preempting_up(tmp_path: Path, preempting_server_bin: Path,
                      tiny_model: Path) -> Iterator[RunUp]:  # fmt: skip
    """Factory: run_preempting_up(*up_args, env=...) -> a started UpProcess (always stopped).

    It serves the tiny test model.
    """
    started: list[UpProcess] = []

    def make(*args: str, env: dict[str, str] | None = None) -> UpProcess:
        up = UpProcess(["--server-bin", str(preempting_server_bin), "--model", str(tiny_model),
                        *args],
                       tmp_path / f"up{len(started)}", env=env or {})  # fmt: skip
        up.log_dir.mkdir(parents=True)
        started.append(up)
        return up.start(timeout=240)

    yield make
    for up in started:
        up.kill()

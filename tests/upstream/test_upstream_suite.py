"""llama.cpp's own server suite, offline (tests/upstream/suite.py): one test of it here, on the
stock and the patched build; the whole suite is `python -m tests.upstream.suite` (minutes).

`test_sleep.py::test_server_sleep_read_only_endpoints`: while the server sleeps, `/metrics` must
read exactly as it did awake (and must not wake it). The patched build's KV gauges read the
pool's cells awake and 0 asleep, which failed it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.upstream.suite import prepare, run_suite, source_tree

pytestmark = [pytest.mark.server, pytest.mark.stock]

SLEEP_TEST = "unit/test_sleep.py::test_server_sleep_read_only_endpoints"


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(tmp_path_factory.mktemp("upstream"), source_tree())


@pytest.mark.parametrize("build", ["stock", "patched"])
def test_sleep_read_only_endpoints(build: str, suite_dir: Path, tiny_model: Path,
                                   llama_server_bin: Path, stock_server_bin: Path) -> None:
    binary = stock_server_bin if build == "stock" else llama_server_bin
    outcomes, _ = run_suite(binary, suite_dir, [SLEEP_TEST], tiny_model, build)
    got = outcomes.get(SLEEP_TEST)
    assert got is not None, f"the test did not run: {outcomes}"
    assert got.outcome == "passed", f"{build}: {got.outcome}: {got.why}"

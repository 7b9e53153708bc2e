"""Shared fixtures: the built servers, the generated models, a server factory.

The binaries come from build_llama.sh (cached, so this is instant after `make test` built
them); LLAMA_SERVER_BIN / LLAMA_SERVER_STOCK_BIN point the suite at other builds, which is
how the fixed-deadline test is shown to fail on the stock server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from sidecar.cli.build import server_binary
from sidecar.paths import cache_dir
from tests.support.llama import LlamaServer
from tests.support.tinymodel import ensure_model

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--part", choices=("parallel", "serial"), default=None,
        help="`make test`'s two parts: the tests not marked `serial` (on xdist workers), "
        "or only those marked `serial` (one at a time); default: all",
    )  # fmt: skip


# The files that take longest (worker-seconds on an idle two-core machine, longest first). With
# `--dist loadfile --no-loadscope-reorder` xdist hands files to the workers in collection order, so
# these go first and the short ones fill the gaps at the end: a long file handed out last would run
# alone while the other worker idles. Only an order: a stale or missing entry costs time, not tests.
LONGEST_FIRST = (
    "tests/ui/test_chat_page.py",
    "tests/server/test_preempt_pool.py",
    "tests/server/test_preempt_liveness.py",
    "tests/server/test_preempt_fuzz.py",
    "tests/server/test_preempt_defects.py",
    "tests/tooling/test_build_ui.py",
    "tests/server/test_preempt_multimodal.py",
    "tests/server/test_preempt_kv.py",
    "tests/proxy/test_lifecycle.py",
)


def _longest_first(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_longest_first)  # stable: the rest keep their order
    part = config.getoption("--part")
    if part is None:
        return
    want = part == "serial"
    keep = [i for i in items if (i.get_closest_marker("serial") is not None) == want]
    dropped = [i for i in items if (i.get_closest_marker("serial") is not None) != want]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _binary(stock: bool) -> Path:
    try:
        return server_binary(stock=stock)
    except (FileNotFoundError, RuntimeError) as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    return _binary(stock=False)


@pytest.fixture(scope="session")
def stock_server_bin() -> Path:
    return _binary(stock=True)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_model(cache_dir() / "models", "tiny")


@pytest.fixture(scope="session")
def slow_model() -> Path:
    return ensure_model(cache_dir() / "models", "slow")


StartServer = Callable[..., LlamaServer]


@pytest.fixture
def start_server(llama_server_bin: Path, tiny_model: Path,
                 tmp_path: Path) -> Iterator[StartServer]:
    """Factory: start_server(model=..., args=[...], env={...}, binary=None, test_knobs=None)
    -> LlamaServer (test_knobs: see LlamaServer).

    Every server it starts is stopped at teardown; its log stays in tmp_path.
    """
    started: list[LlamaServer] = []

    def start(model: Path | None = None, args: Sequence[str] = (),
              env: Mapping[str, str] | None = None, binary: Path | None = None,
              timeout: float = 120.0, test_knobs: bool | None = None) -> LlamaServer:
        n = len(started)
        srv = LlamaServer(binary or llama_server_bin, model or tiny_model, list(args),
                          dict(env or {}), log_path=tmp_path / f"llama-server-{n}.log",
                          test_knobs=test_knobs)
        started.append(srv)
        return srv.start(timeout=timeout)

    yield start
    for srv in started:
        srv.stop()

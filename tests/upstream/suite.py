"""llama.cpp's own server suite against the stock and the patched llama-server, side by side.

The pinned source (the tree build_llama.sh extracts from the sdist) carries llama-server's pytest
suite, `tools/server/tests/unit`. It starts the binary named by LLAMA_SERVER_BIN_PATH for each test
and fetches its models from the Hugging Face hub, which cannot be reached here. This module runs it
offline:

* the suite is copied to a work directory (the cached tree is never written to), beside links to
  the tree's `models/` and `tools/mtmd/` so that its relative paths still resolve;
* a pytest plugin (`PLUGIN` below, loaded with `-p`) replaces every hub model by one generated
  model (tests/support/tinymodel.py; the test's other flags are kept; a downloaded draft model
  is that model too), skips with a reason every test that needs a LoRA adapter or a multimodal
  projector from the hub, stands in for the two requirements
  the project's venv does not carry (`wget`, used only to download, and `filelock`, which only
  serializes parallel workers: the suite runs serially here), bounds each test to `TEST_TIMEOUT_S`
  and records each test's outcome;
* the suite runs on stock, then on the patched build the tests that passed on stock (`--all`:
  every test), and the outcomes are compared: a test that passes on stock and not on the
  patched build is a regression (exit status 1).

Tests whose assertions need the hub model's vocabulary or outputs fail on both builds: they are
listed as such, not counted as regressions.

    .venv/bin/python -m tests.upstream.suite                   # the whole unit/ suite
    .venv/bin/python -m tests.upstream.suite unit/test_sleep.py unit/test_metrics.py
    .venv/bin/python -m tests.upstream.suite --patched BIN --stock BIN --json out.json
    .venv/bin/python -m tests.upstream.suite --stock-from out.json   # stock's outcomes reused

The binaries default to build_llama.sh's (LLAMA_SERVER_BIN / LLAMA_SERVER_STOCK_BIN override).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sidecar.cli.build import server_binary
from sidecar.paths import REPO, cache_dir
from tests.support.procs import free_port
from tests.support.tinymodel import ensure_model

TEST_TIMEOUT_S = 120

PLUGIN = '''
"""Written by tests/upstream/suite.py: runs llama.cpp's server suite offline (see there)."""
import json
import os
import signal
import sys
import types

import pytest

if "wget" not in sys.modules:
    try:
        import wget  # noqa: F401
    except ImportError:
        stub = types.ModuleType("wget")
        def _download(url, out=None):
            raise RuntimeError("no download here: " + url)
        stub.download = _download
        sys.modules["wget"] = stub
try:
    import filelock  # noqa: F401
except ImportError:
    stub = types.ModuleType("filelock")
    class FileLock:
        def __init__(self, path):
            self.path = path
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return False
    stub.FileLock = FileLock
    sys.modules["filelock"] = stub

import utils  # noqa: E402

MODEL = os.environ["UPSTREAM_MODEL"]
RESULTS = os.environ["UPSTREAM_RESULTS"]
TIMEOUT = int(os.environ.get("UPSTREAM_TEST_TIMEOUT", "120"))

_start = utils.ServerProcess.start


def _offline_start(self, *args, **kwargs):
    if self.model_hf_repo or self.model_hf_file or self.model_url:
        self.model_hf_repo = None
        self.model_hf_file = None
        self.model_url = None
        self.model_file = MODEL
    if self.mmproj_url:
        pytest.skip("needs a multimodal projector from the hub: " + self.mmproj_url)
    if self.lora_files and MODEL in self.lora_files:
        pytest.skip("needs a LoRA adapter from the hub (the generated model is no adapter)")
    return _start(self, *args, **kwargs)


def _download(url, output_file_path=None):
    # a model (the speculative tests' draft) is the generated model too; a server given it as a
    # LoRA adapter is skipped when it starts
    return MODEL


utils.ServerProcess.start = _offline_start
utils.download_file = _download
utils.ServerPreset.load_all = staticmethod(lambda: None)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout(f"the test ran past {TIMEOUT} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


_outcomes = {}


def pytest_runtest_logreport(report):
    key = report.nodeid
    prev = _outcomes.get(key)
    if report.when == "call" or report.outcome != "passed":
        if prev is None or prev["outcome"] == "passed":
            why = ""
            if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                why = str(report.longrepr[2])
            elif report.outcome == "failed":
                text = report.longreprtext.strip().splitlines()
                errs = [ln[1:].strip() for ln in text if ln.startswith("E ")]
                why = " | ".join([*errs[:2], *text[-1:]])[:400]
            _outcomes[key] = {"outcome": report.outcome, "when": report.when, "why": why,
                              "duration": round(report.duration, 2)}


def pytest_sessionfinish(session):
    with open(RESULTS, "w") as f:
        json.dump(_outcomes, f, indent=1, sort_keys=True)
'''


def source_tree() -> Path:
    """The pinned llama.cpp tree build_llama.sh extracted (it must have built once)."""
    env = (REPO / "server_patch" / "upstream.env").read_text()
    sha = next(line.split("=", 1)[1].strip().strip('"') for line in env.splitlines()
               if line.startswith("SDIST_SHA256="))
    tree = cache_dir() / "src" / f"llama.cpp-{sha[:16]}"
    if not (tree / "tools" / "server" / "tests" / "unit").is_dir():
        raise FileNotFoundError(f"no pinned source at {tree}: run ./build_llama.sh first")
    return tree


def prepare(work: Path, tree: Path) -> Path:
    """A copy of the suite under `work` (with links to what its relative paths reach) and the
    plugin; returns the suite's directory (where pytest runs)."""
    tests = work / "tools" / "server" / "tests"
    if tests.exists():
        shutil.rmtree(tests)
    shutil.copytree(tree / "tools" / "server" / "tests", tests,
                    ignore=shutil.ignore_patterns("__pycache__", "tmp", ".pytest_cache"))
    for rel in ("models", "tools/mtmd"):
        link = work / rel
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(tree / rel)
    (tests / "tmp").mkdir(exist_ok=True)
    (tests / "sidecar_offline.py").write_text(PLUGIN)
    return tests


@dataclass
class Outcome:
    outcome: str  # passed, failed, skipped
    why: str
    duration: float


def run_suite(binary: Path, tests: Path, selection: list[str], model: Path, label: str,
              timeout_s: int = TEST_TIMEOUT_S) -> tuple[dict[str, Outcome], float]:
    """Run the suite (or `selection`, paths relative to the suite's directory) against `binary`;
    returns the outcome per test id and the wall time."""
    results = tests / f"results-{label}.json"
    results.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update({
        "LLAMA_SERVER_BIN_PATH": str(binary),
        "UPSTREAM_MODEL": str(model),
        "UPSTREAM_RESULTS": str(results),
        "UPSTREAM_TEST_TIMEOUT": str(timeout_s),
        "PORT": str(free_port()),
        "PYTHONPATH": str(tests),
    })
    env.pop("SLOW_TESTS", None)
    env.pop("DEBUG", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "sidecar_offline", "-p", "no:cacheprovider",
           "-q", "--rootdir", str(tests), "-c", str(tests / "pytest.ini"),
           *(selection or ["unit"])]
    t0 = time.monotonic()
    with (tests / f"pytest-{label}.log").open("w") as log:
        subprocess.run(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT,
                       check=False)
    wall = time.monotonic() - t0
    if not results.exists():
        tail = (tests / f"pytest-{label}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the suite did not run on {binary}:\n{tail}")
    raw = json.loads(results.read_text())
    return {k: Outcome(v["outcome"], v["why"], v["duration"]) for k, v in raw.items()}, wall


def compare(stock: dict[str, Outcome], patched: dict[str, Outcome]) -> list[str]:
    """Tests that pass on stock and not on the patched build."""
    return sorted(k for k, v in stock.items()
                  if v.outcome == "passed" and patched.get(k, Outcome("missing", "", 0)).outcome
                  != "passed")


def default_binary(stock: bool) -> Path:
    try:
        path = server_binary(stock=stock, print_path=True)
    except RuntimeError:
        path = Path()
    if not path.is_file():
        where = f" at {path}" if path.parts else ""
        raise SystemExit(f"no {'stock' if stock else 'patched'} build{where}: run ./build_llama.sh"
                         f"{' --stock' if stock else ''}")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("selection", nargs="*", help="test files or ids under the suite's directory "
                    "(default: unit)")
    ap.add_argument("--patched", type=Path, help="the patched llama-server")
    ap.add_argument("--stock", type=Path, help="the stock llama-server")
    ap.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write the outcomes side by side here")
    ap.add_argument("--timeout", type=int, default=TEST_TIMEOUT_S, help="seconds per test")
    ap.add_argument("--all", action="store_true", help="run the patched build on every test, "
                    "not only on those that pass on stock")
    ap.add_argument("--stock-from", type=Path, help="take the stock outcomes from an earlier "
                    "--json file instead of running the suite on stock again (it does not "
                    "change with the patch series)")
    args = ap.parse_args(argv)

    patched = args.patched or default_binary(stock=False)
    stock = args.stock or (Path("(earlier run)") if args.stock_from
                           else default_binary(stock=True))
    model = ensure_model(cache_dir() / "models", "tiny")
    try:
        tree = source_tree()
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="upstream-suite-") as tmp:
        work = args.work or Path(tmp)
        tests = prepare(work, tree)
        if args.stock_from:
            earlier = json.loads(args.stock_from.read_text())
            out_stock = {k: Outcome(**v) for k, v in earlier["stock"].items()
                         if not args.selection or any(k.startswith(sel.rstrip("/"))
                                                      for sel in args.selection)}
            t_stock = float(earlier["wall_s"]["stock"])
        else:
            out_stock, t_stock = run_suite(stock, tests, args.selection, model, "stock",
                                           args.timeout)
        # a test that fails on stock cannot be a regression: the patched build runs the rest
        # (with --all, everything)
        only = args.selection if args.all else sorted(
            k for k, v in out_stock.items() if v.outcome == "passed")
        out_patched, t_patched = (run_suite(patched, tests, only, model, "patched", args.timeout)
                                  if only else ({}, 0.0))
    regressions = compare(out_stock, out_patched)
    names = sorted(set(out_stock) | set(out_patched))
    missing = Outcome("not run", "", 0)
    width = max((len(n) for n in names), default=10)
    print(f"{'test':<{width}}  stock    patched")
    for n in names:
        s, p = out_stock.get(n, missing), out_patched.get(n, missing)
        mark = "  REGRESSION" if n in regressions else ""
        why = f"  ({p.why or s.why})" if "skipped" in (s.outcome, p.outcome) else ""
        print(f"{n:<{width}}  {s.outcome:<8} {p.outcome:<8}{mark}{why}")

    def tally(o: dict[str, Outcome]) -> str:
        c = {k: sum(1 for v in o.values() if v.outcome == k) for k in
             ("passed", "failed", "skipped")}
        return ", ".join(f"{v} {k}" for k, v in c.items())

    print(f"\nstock ({stock}): {tally(out_stock)} in {t_stock:.0f} s")
    print(f"patched ({patched}): {tally(out_patched)} in {t_patched:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "stock": {k: v.__dict__ for k, v in out_stock.items()},
            "patched": {k: v.__dict__ for k, v in out_patched.items()},
            "wall_s": {"stock": round(t_stock, 1), "patched": round(t_patched, 1)},
            "regressions": regressions,
        }, indent=1, sort_keys=True))
    if regressions:
        print(f"\n{len(regressions)} passed on stock and not on the patched build:")
        for n in regressions:
            got = out_patched.get(n, missing)
            print(f"  {n}: {got.outcome}: {got.why}")
        return 1
    print("\nthe patched build passes every test the stock build passes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

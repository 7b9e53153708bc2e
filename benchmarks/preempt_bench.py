"""KV preemption benchmarks (issue 4): what parking costs and what it buys.

    python -m benchmarks.preempt_bench [--rounds N] [--only cost,overload,swap] [--json FILE]

1. cost:     tokens/s of the stock build vs the patched build with --preempt-ram on, when
             nothing parks (1 stream; 2 streams that fit), runs interleaved A B A B.
2. overload: four chats that overflow the pool together: stock (completed, errored) vs patched
             (completed, wall time, parks per chat, longest wait of any chat) vs the four solo
             runs back to back; patched outputs are compared byte for byte with the solo runs.
3. swap:     park/restore throughput (MiB/s, from the server's own log lines, which time the
             copy) against a host memcpy of the same sizes measured in the same run.

Figures are ratios measured side by side in one run; the machine and its load change the
absolute numbers. The binaries come from build_llama.sh (LLAMA_SERVER_BIN and
LLAMA_SERVER_STOCK_BIN override them), the models from tests.support.tinymodel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sidecar.paths import cache_dir
from tests.server.preempt_helpers import (
    BASE,
    CONTEXT_ERROR,
    complete,
    complete_many,
    metrics,
    robust_prompts,
    run_concurrently,
    token_prompt,
)
from tests.support.llama import LlamaServer
from tests.support.tinymodel import ensure_model

REPO = Path(__file__).resolve().parent.parent


def binary(stock: bool) -> Path:
    override = os.environ.get("LLAMA_SERVER_STOCK_BIN" if stock else "LLAMA_SERVER_BIN")
    if override:
        return Path(override)
    out = subprocess.run(
        [str(REPO / "build_llama.sh"), *(["--stock"] if stock else [])],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return Path(out.strip().splitlines()[-1])


class Servers:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[LlamaServer] = []

    def start(
        self, stock: bool, model: Path, args: list[str], env: dict[str, str] | None = None
    ) -> LlamaServer:
        log = self.workdir / f"server-{len(self.started)}-{'stock' if stock else 'patched'}.log"
        srv = LlamaServer(binary(stock), model, args, env or {}, log_path=log)
        self.started.append(srv)
        return srv.start()

    def stop_all(self) -> None:
        for srv in self.started:
            srv.stop()


# 1 ---------------------------------------------------------------------------------------------


def bench_cost(servers: Servers, model: Path, rounds: int, n_predict: int) -> dict[str, Any]:
    args = [*BASE, "-c", "4096", "-np", "2"]
    stock = servers.start(True, model, args)
    patched = servers.start(False, model, [*args, "--preempt-ram", "8192"])
    prompts = [token_prompt(16, 1), token_prompt(16, 2)]
    out: dict[str, Any] = {}
    for n_streams in (1, 2):
        tps: dict[str, list[float]] = {"stock": [], "patched": []}
        for _ in range(rounds):
            for name, srv in (("stock", stock), ("patched", patched)):
                t0 = time.monotonic()
                res = run_concurrently(
                    [lambda p=p, u=srv.url: complete(u, p, n_predict) for p in prompts[:n_streams]]
                )
                wall = time.monotonic() - t0
                assert all(r.ok and r.n_predicted == n_predict for r in res), [r.error for r in res]
                tps[name].append(n_streams * n_predict / wall)
        m = metrics(patched.url)
        assert m["n_preempt_total"] == 0, "something parked in the no-pressure benchmark"
        s, p = statistics.median(tps["stock"]), statistics.median(tps["patched"])
        s_best, p_best = max(tps["stock"]), max(tps["patched"])
        out[f"{n_streams}_stream"] = {
            "stock_tps": s,
            "patched_tps": p,
            "ratio": p / s,
            "stock_best_tps": s_best,
            "patched_best_tps": p_best,
            "ratio_best": p_best / s_best,
            "runs": tps,
        }
    return out


# 2 ---------------------------------------------------------------------------------------------


def bench_overload(servers: Servers, model: Path, n_predict: int) -> dict[str, Any]:
    args = [*BASE, "-c", "256", "-np", "4"]
    stock = servers.start(True, model, args)
    patched = servers.start(False, model, [*args, "--preempt-ram", "8192"])
    # prompts whose greedy path has no near-tie, so that "byte-identical" tests the parks
    prompts = robust_prompts(patched.url, 4, 8, n_predict)

    def together(url: str) -> tuple[float, list[Any]]:
        # one request with four prompts: the four chats start in the same iteration
        t0 = time.monotonic()
        res = complete_many(url, prompts, n_predict)
        return time.monotonic() - t0, res

    t_stock, res_stock = together(stock.url)
    solo = []
    t_solo = 0.0
    for p in prompts:
        t0 = time.monotonic()
        solo.append(complete(patched.url, p, n_predict))
        t_solo += time.monotonic() - t0
    t_patched, res_patched = together(patched.url)

    identical = all(
        r.ok and s.ok and r.tokens == s.tokens and r.content == s.content
        for r, s in zip(res_patched, solo, strict=True)
    )
    return {
        "n_predict": n_predict,
        "stock": {
            "completed": sum(1 for r in res_stock if r.ok),
            "errored": sum(1 for r in res_stock if r.error is not None),
            "context_errors": sum(1 for r in res_stock if r.error_message == CONTEXT_ERROR),
            "wall_s": t_stock,
        },
        "patched": {
            "completed": sum(1 for r in res_patched if r.ok and r.n_predicted == n_predict),
            "wall_s": t_patched,
            "parks_per_chat": [r.preempt.get("parks", 0) for r in res_patched],
            "longest_wait_s": max(r.longest_wait for r in res_patched),
            "identical_to_solo": identical,
        },
        "solo_sum_s": t_solo,
        "patched_over_solo_sum": t_patched / t_solo,
    }


# 3 ---------------------------------------------------------------------------------------------

PARK_RE = re.compile(r"state ([0-9.]+) MiB saved to host RAM in ([0-9.]+) ms")
RESUME_RE = re.compile(r"state ([0-9.]+) MiB restored in ([0-9.]+) ms")


def memcpy_mib_s(n_mib: float, repeat: int = 5, cold: bool = False) -> float:
    """Best host memcpy rate for n_mib: into a warm buffer, or (cold) into a fresh allocation whose
    pages fault in during the copy, as a park's new host buffer does."""
    import numpy as np

    n = max(1, int(n_mib * 1024 * 1024))
    src = np.frombuffer(os.urandom(n), dtype=np.uint8).copy()
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeat):
        if cold:
            dst = np.empty_like(src)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return n / (1024 * 1024) / best


def bench_swap(
    servers: Servers, model: Path, prompt_len: int, n_predict: int, every: int
) -> dict[str, Any]:
    srv = servers.start(
        False,
        model,
        [*BASE, "-c", "4096", "-np", "2", "--preempt-ram", "-1"],
        env={"LLAMA_SERVER_PREEMPT_EVERY": str(every)},
    )
    res = complete(srv.url, token_prompt(prompt_len, 3), n_predict)
    assert res.ok, res.error
    log = srv.log_text()
    parks = [(float(a), float(b)) for a, b in PARK_RE.findall(log)]
    resumes = [(float(a), float(b)) for a, b in RESUME_RE.findall(log)]
    assert parks and resumes, "no swap in the log"

    def rates(items: list[tuple[float, float]]) -> list[float]:
        return [mib / (ms / 1e3) for mib, ms in items if ms > 0]

    sizes = [mib for mib, _ in parks]
    copy_rate = statistics.median([memcpy_mib_s(mib) for mib in sizes])
    cold_rate = statistics.median([memcpy_mib_s(mib, cold=True) for mib in sizes])
    park_rate = statistics.median(rates(parks))
    resume_rate = statistics.median(rates(resumes))
    return {
        "n_parks": len(parks),
        "state_mib_median": statistics.median(sizes),
        "park_mib_s": park_rate,
        "restore_mib_s": resume_rate,
        "memcpy_warm_mib_s": copy_rate,
        "memcpy_cold_mib_s": cold_rate,
        "park_over_memcpy_warm": park_rate / copy_rate,
        "park_over_memcpy_cold": park_rate / cold_rate,
        "restore_over_memcpy_warm": resume_rate / copy_rate,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rounds", type=int, default=8, help="A B rounds per cost workload (default 8)"
    )
    ap.add_argument("--only", default="cost,overload,swap", help="comma-separated subset")
    ap.add_argument("--cost-tokens", type=int, default=1024)
    ap.add_argument("--overload-tokens", type=int, default=100)
    ap.add_argument(
        "--model", default="tiny", choices=["tiny", "slow"], help="model for cost and overload"
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()

    only = set(a.only.split(","))
    model = ensure_model(cache_dir() / "models", a.model)
    results: dict[str, Any] = {"model": a.model, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="preempt-bench-") as tmp:
        servers = Servers(Path(tmp))
        try:
            if "cost" in only:
                results["cost"] = bench_cost(servers, model, a.rounds, a.cost_tokens)
                print(json.dumps({"cost": results["cost"]}, indent=1), flush=True)
            if "overload" in only:
                results["overload"] = bench_overload(servers, model, a.overload_tokens)
                print(json.dumps({"overload": results["overload"]}, indent=1), flush=True)
            if "swap" in only:
                results["swap"] = bench_swap(
                    servers,
                    ensure_model(cache_dir() / "models", "slow"),
                    prompt_len=1500,
                    n_predict=96,
                    every=16,
                )
                print(json.dumps({"swap": results["swap"]}, indent=1), flush=True)
        finally:
            servers.stop_all()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

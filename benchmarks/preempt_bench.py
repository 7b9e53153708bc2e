"""KV preemption benchmarks: what parking costs and what it buys.

    python -m benchmarks.preempt_bench [--rounds N] [--only cost,overload,swap] [--json FILE]

1. cost:     tokens/s of the stock build vs the patched build with --preempt-ram on, when
             nothing parks (1 stream; 2 streams that fit), runs interleaved A B A B.
2. overload: four chats that overflow the pool together: stock (completed, errored) vs patched
             (completed, wall time, parks per chat, longest wait of any chat) vs the four solo
             runs back to back; patched outputs are compared byte for byte with the solo runs.
3. swap:     park/restore throughput (MiB/s, from the server's own log lines, which time the
             copy) against a warm, a cold and an out-of-cache host memcpy of the same sizes
             measured in the same run, for states from ~4 MiB to ~1.1 GiB (a generated wide-KV
             model), and the stall a resident stream feels (its longest inter-token gap across a
             park over its median step, and the same gap less the forced park's two copies, park
             and restore: what overlapping them with the next decode could save at best);
             `--before BIN` measures a second build side by side.
4. pressure: the first park of a busy period under real pressure (no forced parks): two chats
             on the wide-KV model overflow the pool together and the planner parks the smaller
             (~0.95 GiB); its rate against a memcpy, whether it took a block the pool prefaulted
             in the background, and the other stream's stall; `--before BIN` as for swap.

Figures are ratios measured side by side in one run; the machine and its load change the
absolute numbers. The binaries come from build_llama.sh (LLAMA_SERVER_BIN and
LLAMA_SERVER_STOCK_BIN override them), the models from tests.support.tinymodel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sidecar.cli.build import server_binary
from sidecar.paths import cache_dir
from tests.server.preempt_helpers import (
    BASE,
    CONTEXT_ERROR,
    PARK_RE,
    complete,
    complete_many,
    metrics,
    robust_prompts,
    run_concurrently,
    slots,
    token_prompt,
    wait_for,
)
from tests.support.llama import LlamaServer
from tests.support.tinymodel import ensure_model


class Servers:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[LlamaServer] = []

    def start(
        self, stock: bool, model: Path, args: list[str], env: dict[str, str] | None = None
    ) -> LlamaServer:
        label = "stock" if stock else "patched"
        return self.start_bin(server_binary(stock), model, args, env, label)

    def start_bin(
        self,
        path: Path,
        model: Path,
        args: list[str],
        env: dict[str, str] | None = None,
        label: str = "patched",
    ) -> LlamaServer:
        log = self.workdir / f"server-{len(self.started)}-{label}.log"
        srv = LlamaServer(path, model, args, env or {}, log_path=log)
        self.started.append(srv)
        return srv.start(timeout=300)

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

RESUME_RE = re.compile(r"state ([0-9.]+) MiB restored in ([0-9.]+) ms")
# parks through the host pool: where a park's time went
BREAKDOWN_RE = re.compile(
    r"\(size ([0-9.]+) ms, block ([0-9.]+) ms, copy ([0-9.]+) ms, release ([0-9.]+) ms\)"
)
# a block faulted in by the pool's background thread before the park that takes it
PREFAULTED_RE = re.compile(
    r"prefaulted plain block of ([0-9.]+) MiB in ([0-9.]+) ms \(background"
    r"(?:, the park waited ([0-9.]+) ms for its last part)?\)"
)
TAKES_PREFAULTED = "the park takes the prefaulted plain block"


def prefault_fields(log: str) -> dict[str, Any]:
    """The pool's prefault in a server log: whether the first park took a block prefaulted in the
    background, and every prefault (its size, time, and how long a park waited for it)."""
    lines = log.splitlines()
    first_park = next(i for i, ln in enumerate(lines) if PARK_RE.search(ln))
    return {
        "first_park_prefaulted": any(TAKES_PREFAULTED in ln for ln in lines[:first_park]),
        "prefaults": [
            {"mib": float(m), "ms": float(t), "park_waited_ms": float(w) if w else 0.0}
            for m, t, w in PREFAULTED_RE.findall(log)
        ],
    }


# Read before each copy of an `evicted` memcpy: four times the 32 MiB L3 of the benchmark machine
# (and of most servers' per-socket L3), so that neither buffer is left in any CPU cache.
EVICT_MIB = 128


def memcpy_mib_s(
    n_mib: float, repeat: int = 5, cold: bool = False, threads: int = 1, evicted: bool = False
) -> float:
    """Best host memcpy rate for n_mib: into a warm buffer, or (cold) into a fresh anonymous
    mapping whose pages fault in during the copy, as a park's new host buffer does (a fresh mmap
    each time: numpy's allocator would hand a freed buffer of a few MiB straight back, warm).
    With `threads` > 1 the bytes are split in shares of at least 4 MiB, at most `threads`,
    copied at once (ctypes.memmove lets go of the GIL): the rule of the server's own copy
    (libllama's patched state copy), and the reference for it.

    `evicted`: a warm buffer, but both buffers are pushed out of the CPU caches before each copy
    by reading EVICT_MIB of other memory. That is what a park meets: between two parks every
    decode step streams the model's weights through the caches, so a slot's KV cells and the
    pool block come from DRAM. A plain warm copy of a few MiB repeats inside the L2/L3 cache and
    runs several times faster than DRAM allows (at 4 MiB here: 39-46 GB/s, out of cache 7-12)."""
    import ctypes
    import mmap

    import numpy as np

    n = max(1, int(n_mib * 1024 * 1024))
    threads = max(1, min(threads, n // (4 << 20)))
    src = np.frombuffer(os.urandom(n), dtype=np.uint8).copy()
    evict = np.ones(EVICT_MIB << 17, dtype=np.uint64) if evicted else None  # EVICT_MIB MiB
    best = float("inf")
    if not cold:
        dst = np.empty_like(src)
        np.copyto(dst, src)
    for _ in range(repeat):
        if evict is not None:
            int(evict.sum())  # a read of every line: the two buffers leave the caches
        if cold:
            m = mmap.mmap(-1, n)
            dst = np.frombuffer(m, dtype=np.uint8)
        if threads == 1:
            t0 = time.perf_counter()
            np.copyto(dst, src)
        else:
            d0, s0 = dst.ctypes.data, src.ctypes.data
            cuts = [n * i // threads for i in range(threads + 1)]
            workers = [
                threading.Thread(target=ctypes.memmove, args=(d0 + lo, s0 + lo, hi - lo))
                for lo, hi in itertools.pairwise(cuts)
            ]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        best = min(best, time.perf_counter() - t0)
        if cold:
            del dst
            m.close()
    return n / (1024 * 1024) / best


# A model whose KV is wide and whose compute is narrow: 128 layers of 16 heads of 256 (4096 K and
# 4096 V values per token and layer) on a 64-wide residual stream. With F16 KV a token's state is
# 2 MiB, so ~520 tokens reach 1 GiB while a prefill stays within a minute on one loaded core.
# (F32 KV would halve the tokens, but the CPU flash-attention path for F32 K is ~10x slower.)
WIDE = {"n_embd": 64, "n_layer": 128, "n_head": 16, "head_dim": 256, "n_ff": 128, "seed": 99}


def wide_model() -> Path:
    import gguf
    import numpy as np

    # the generated models' vocabulary
    from tests.support.tinymodel import _vocab, add_vocab, open_writer, save_model, seeded_normal

    w_ = WIDE
    path = (
        cache_dir()
        / "models"
        / (
            f"llama-sidecar-widekv-s{w_['seed']}-d{w_['n_embd']}x{w_['n_layer']}"
            f"-h{w_['n_head']}x{w_['head_dim']}.gguf"
        )
    )
    if path.exists():
        return path
    normal = seeded_normal(w_["seed"], np.float16)
    d, hd, nh, ff = w_["n_embd"], w_["head_dim"], w_["n_head"], w_["n_ff"]
    n_vocab = len(_vocab()[0])

    w, tmp = open_writer(path, "llama")
    w.add_name("llama-sidecar widekv random")
    w.add_context_length(65536)
    w.add_embedding_length(d)
    w.add_block_count(w_["n_layer"])
    w.add_feed_forward_length(ff)
    w.add_head_count(nh)
    w.add_head_count_kv(nh)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_vocab(w)
    ones = np.ones(d, dtype=np.float32)
    w.add_tensor("token_embd.weight", normal((n_vocab, d), 1.0, np.float32))
    for i in range(w_["n_layer"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(f"blk.{i}.{name}.weight", normal((nh * hd, d), d**-0.5))
        w.add_tensor(f"blk.{i}.attn_output.weight", normal((d, nh * hd), (nh * hd) ** -0.5))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", normal((ff, d), d**-0.5, np.float32))
        w.add_tensor(f"blk.{i}.ffn_up.weight", normal((ff, d), d**-0.5, np.float32))
        w.add_tensor(f"blk.{i}.ffn_down.weight", normal((d, ff), ff**-0.5, np.float32))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", normal((n_vocab, d), 1.0, np.float32))
    return save_model(w, tmp, path)


def slot_decoded(url: str) -> int:
    return max(
        (s["next_token"][0]["n_decoded"] for s in slots(url) if s["is_processing"]), default=0
    )


def copy_args(threads: int) -> list[str]:
    """Server flags for a park's copy threads: a state copy may use the batch threads (-tb),
    generation keeps BASE's one thread (-t)."""
    return ["-tb", str(threads)]


def swap_case(
    servers: Servers,
    binary_path: Path,
    model: Path,
    extra: list[str],
    prompt_len: int,
    every: int,
    copy_threads: int = 1,
) -> dict[str, Any]:
    """One stream B of `prompt_len` tokens parked (forced) after every `every` generated tokens,
    three times; a second stream A, too short to be parked itself, generates across B's second
    park (B's first park may allocate a pool block, the later ones reuse it)."""
    n_ctx = prompt_len + 4 * every + 64
    srv = servers.start_bin(
        binary_path,
        model,
        [*BASE, *copy_args(copy_threads), "-c", str(n_ctx), "-np", "2",
         "--preempt-ram", "-1", "--cache-ram", "0", *extra],
        env={"LLAMA_SERVER_PREEMPT_EVERY": str(every)},
    )
    res_b: dict[str, Any] = {}

    def run_b() -> None:
        res_b["c"] = complete(srv.url, token_prompt(prompt_len, 3), 3 * every + 2, timeout=900)

    tb = threading.Thread(target=run_b, daemon=True)
    tb.start()
    wait_for(lambda: slot_decoded(srv.url) >= every + every // 2, timeout=600, what="B's tokens")
    a = complete(srv.url, token_prompt(8, 4), every - 1, timeout=600)
    tb.join(900)
    b = res_b["c"]
    assert a.ok and b.ok, (a.error, b.error)
    assert a.preempt["parks"] == 0 and b.preempt["parks"] == 3, (a.preempt, b.preempt)
    log = srv.log_text()
    srv.stop()
    parks = [(float(x), float(y)) for x, y in PARK_RE.findall(log)]
    resumes = [(float(x), float(y)) for x, y in RESUME_RE.findall(log)]
    gaps = [
        t1 - t0 for t0, t1 in zip(a.t_events[1:], a.t_events[2:], strict=False)
    ]  # after A's first token
    step = statistics.median(gaps)
    # B's second park and its restore: a forced park is restored in the same pass of the server
    # loop (room is there), so A's gap across it holds both copies. They are what an overlap with
    # the next decode could hide at best: the stall with that much taken off A's longest gap
    copy_ms = parks[1][1] + resumes[1][1]
    return {
        "parks": parks,
        "park_breakdown_ms": [
            dict(zip(("size", "block", "copy", "release"), map(float, m), strict=True))
            for m in BREAKDOWN_RE.findall(log)
        ],
        "resumes": resumes,
        **prefault_fields(log),  # did B's first park take a prefaulted block (and wait for it)?
        "a_gaps_s": gaps,
        "stall_steps": max(gaps) / step,
        "copy_ms": copy_ms,
        "stall_steps_copy_hidden": max(max(gaps) - copy_ms / 1e3, step) / step,
    }


def bench_swap(servers: Servers, before: Path | None, copy_threads: int = 1) -> dict[str, Any]:
    """Park/restore MiB/s of the binary under test (and of `before`, side by side, same run)
    against a host memcpy of the same sizes, from a few MiB to over 1 GiB; with `copy_threads`
    > 1 also against a memcpy split over that many threads."""
    slow = ensure_model(cache_dir() / "models", "slow")
    wide = wide_model()
    cases = [
        # name, model, extra args, prompt length, park every
        ("slow-f16-150", slow, [], 150, 16),
        ("slow-f16-1500", slow, [], 1500, 16),
        ("wide-f16-112", wide, [], 112, 8),
        ("wide-f16-520", wide, [], 520, 8),
    ]
    builds = [("after", server_binary(False))] + ([("before", before)] if before else [])
    out: dict[str, Any] = {"load_before": os.getloadavg(), "copy_threads": copy_threads}
    out["cases"] = {}
    for name, model, extra, prompt_len, every in cases:
        case: dict[str, Any] = {}
        for label, path in builds:
            r = swap_case(servers, path, model, extra, prompt_len, every, copy_threads)
            sizes = [mib for mib, _ in r["parks"]]
            park = [mib / (ms / 1e3) for mib, ms in r["parks"]]
            rest = [mib / (ms / 1e3) for mib, ms in r["resumes"]]
            mib = statistics.median(sizes)
            # the memcpy reference right after this build's run, so that both see the same load
            rep = 5 if mib < 256 else 2
            warm, cold = memcpy_mib_s(mib, repeat=rep), memcpy_mib_s(mib, repeat=rep, cold=True)
            warm_mt = memcpy_mib_s(mib, repeat=rep, threads=copy_threads)
            evicted = memcpy_mib_s(mib, repeat=rep, evicted=True)
            c = case[label] = {
                "state_mib": mib,
                "park_first_mib_s": park[0],
                "park_mib_s": statistics.median(park[1:]),
                "restore_mib_s": statistics.median(rest),
                "memcpy_warm_mib_s": warm,
                "memcpy_cold_mib_s": cold,
                "memcpy_warm_threads_mib_s": warm_mt,
                "memcpy_evicted_mib_s": evicted,
                "stall_steps": r["stall_steps"],
                "copy_ms": r["copy_ms"],
                "stall_steps_copy_hidden": r["stall_steps_copy_hidden"],
                "first_park_prefaulted": r["first_park_prefaulted"],
                "a_step_median_ms": 1e3 * statistics.median(r["a_gaps_s"]),
                "a_gap_max_ms": 1e3 * max(r["a_gaps_s"]),
                "loadavg_1m": os.getloadavg()[0],
                "raw": r,
            }
            for k in ("park_first_mib_s", "park_mib_s", "restore_mib_s"):
                c[k.replace("_mib_s", "_over_warm")] = c[k] / warm
                c[k.replace("_mib_s", "_over_cold")] = c[k] / cold
                c[k.replace("_mib_s", "_over_warm_threads")] = c[k] / warm_mt
                c[k.replace("_mib_s", "_over_evicted")] = c[k] / evicted
            print(name, label, {k: v for k, v in c.items() if k != "raw"}, flush=True)
        out["cases"][name] = case
    out["load_after"] = os.getloadavg()
    return out


def pressure_case(
    servers: Servers, binary_path: Path, model: Path, copy_threads: int = 1
) -> dict[str, Any]:
    """Chat A (440-token prompt) generates; chat B (500) arrives, and once both generate the pool
    (1024 cells; llama.cpp pads a context to a multiple of 256) fills ~37 steps later: the
    planner parks A, the smaller, at ~477 cells (~0.95 GiB), and restores it when B ends. No
    LLAMA_SERVER_PREEMPT_EVERY: whatever prepares A's block must foresee the park from the
    pool's use alone."""
    srv = servers.start_bin(
        binary_path,
        model,
        [*BASE, *copy_args(copy_threads), "-c", "1024", "-np", "2",
         "--preempt-ram", "-1", "--cache-ram", "0"],
    )
    res: dict[str, Any] = {}

    def run_a() -> None:
        res["a"] = complete(srv.url, token_prompt(440, 5), 80, timeout=900)

    ta = threading.Thread(target=run_a, daemon=True)
    ta.start()
    wait_for(lambda: slot_decoded(srv.url) >= 2, timeout=600, what="A's tokens")
    b = complete(srv.url, token_prompt(500, 6), 80, timeout=900)
    ta.join(900)
    a = res["a"]
    assert a.ok and b.ok, (a.error, b.error)
    assert a.preempt["parks"] >= 1 and b.preempt["parks"] == 0, (a.preempt, b.preempt)
    log = srv.log_text()
    srv.stop()
    lines = log.splitlines()
    first_park = next(i for i, ln in enumerate(lines) if PARK_RE.search(ln))
    park = PARK_RE.search(lines[first_park])
    breakdown = BREAKDOWN_RE.search(lines[first_park])
    assert park is not None
    mib, ms = float(park.group(1)), float(park.group(2))
    gaps = [t1 - t0 for t0, t1 in zip(b.t_events[1:], b.t_events[2:], strict=False)]
    return {
        "state_mib": mib,
        "park_ms": ms,
        "park_mib_s": mib / (ms / 1e3),
        "park_breakdown_ms": breakdown.groups() if breakdown else None,
        **prefault_fields(log),
        "b_step_median_ms": 1e3 * statistics.median(gaps),
        "b_gap_max_ms": 1e3 * max(gaps),
        "stall_steps": max(gaps) / statistics.median(gaps),
    }


def bench_pressure(servers: Servers, before: Path | None, copy_threads: int = 1) -> dict[str, Any]:
    wide = wide_model()
    builds = [("after", server_binary(False))] + ([("before", before)] if before else [])
    out: dict[str, Any] = {"load_before": os.getloadavg(), "builds": {}}
    for label, path in builds:
        r = pressure_case(servers, path, wide, copy_threads)
        warm = memcpy_mib_s(r["state_mib"], repeat=2)
        cold = memcpy_mib_s(r["state_mib"], repeat=2, cold=True)
        r.update(
            memcpy_warm_mib_s=warm,
            memcpy_cold_mib_s=cold,
            park_over_warm=r["park_mib_s"] / warm,
            park_over_cold=r["park_mib_s"] / cold,
            loadavg_1m=os.getloadavg()[0],
        )
        print("pressure", label, r, flush=True)
        out["builds"][label] = r
    out["load_after"] = os.getloadavg()
    return out


def swap_table(res: dict[str, Any]) -> str:
    """docs/benchmarks.md rows: ratios to a warm (cold) memcpy, before -> after."""
    rows = [
        "| state | park vs memcpy warm (cold) | first park of a busy period vs warm "
        "| restore vs memcpy warm | park, restore vs a memcpy out of cache "
        "| park, restore vs a memcpy on the copy's threads "
        "| resident stall (max gap / median step) | the same with the copy hidden "
        "| load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, case in res["cases"].items():
        b, a = case.get("before"), case["after"]

        def pair(key: str, fmt: str = "{:.2f}", b: Any = b, a: Any = a) -> str:
            return (fmt.format(b[key]) + " -> " if b else "") + fmt.format(a[key])

        rows.append(
            f"| {a['state_mib']:.1f} MiB ({name}) "
            f"| {pair('park_over_warm')} ({pair('park_over_cold')}) "
            f"| {pair('park_first_over_warm')} "
            f"| {pair('restore_over_warm')} "
            f"| {pair('park_over_evicted')}, {pair('restore_over_evicted')} "
            f"| {pair('park_over_warm_threads')}, {pair('restore_over_warm_threads')} "
            f"| {pair('stall_steps', '{:.1f}')} "
            f"| {pair('stall_steps_copy_hidden', '{:.1f}')} "
            f"| {pair('loadavg_1m', '{:.1f}')} |"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rounds", type=int, default=8, help="A B rounds per cost workload (default 8)"
    )
    ap.add_argument(
        "--only", default="cost,overload,swap", help="comma-separated subset (also: pressure)"
    )
    ap.add_argument("--cost-tokens", type=int, default=1024)
    ap.add_argument("--overload-tokens", type=int, default=100)
    ap.add_argument(
        "--model", default="tiny", choices=["tiny", "slow"], help="model for cost and overload"
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--copy-threads",
        type=int,
        default=1,
        help="swap, pressure: the servers' batch threads (-tb), which a park's copy may use; "
        "generation stays on one thread (default 1)",
    )
    ap.add_argument(
        "--before",
        help="swap: a second llama-server (e.g. the build of main's series) measured side by side "
        "(default: $LLAMA_SERVER_BEFORE_BIN)",
    )
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
            before = a.before or os.environ.get("LLAMA_SERVER_BEFORE_BIN")
            if "swap" in only:
                results["swap"] = bench_swap(
                    servers, Path(before) if before else None, a.copy_threads
                )
                print(swap_table(results["swap"]), flush=True)
            if "pressure" in only:
                results["pressure"] = bench_pressure(
                    servers, Path(before) if before else None, a.copy_threads
                )
        finally:
            servers.stop_all()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

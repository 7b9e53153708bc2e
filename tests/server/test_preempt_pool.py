"""Parked states live in a reused host buffer pool, prefaulted, and copied on the batch threads.

A park serializes the slot's sequence into a block of a pool owned by the preemption mechanism
(pre-faulted, pinned on builds with a GPU device) instead of a fresh allocation; the block goes
back to the pool on restore and to the OS when no request runs. These tests check what must not
change (forced parks give byte-identical tokens, whatever the KV type, with or without a draft
model), what the pool promises (reuse, never above `--preempt-ram`, nothing held once idle) and
its failure path (a block that cannot be allocated means a recompute park, logged). No timing is
asserted: the speed is measured by `benchmarks/preempt_bench.py --only swap`.

Prefault: when a park is likely soon (a forced park is coming, or the pool is filling and the
planner has a victim), a background thread faults in a block for it beforehand, so that the
first park of a busy period does not fault in its block on the main loop. The prefaulted block
is an ordinary pool block once adopted: it counts toward `--preempt-ram` and the gauge, and it
goes back to the OS when idle.

Copy threads: a large state's copy is split over the batch threads (-tb); the bytes that land must
be the same.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BASE,
    PARK,
    PARK_RE,
    complete,
    complete_many,
    metrics,
    robust_prompts,
    robust_solo_completions,
    token_prompt,
    wait_for,
)
from tests.server.test_preempt_kv import assert_same, assert_settled

pytestmark = [pytest.mark.server]

NEW_BLOCK_LINE = "preempt: host pool: new "
PREFAULTING_LINE = "preempt: host pool: prefaulting a plain block of "
PREFAULTED_LINE = "preempt: host pool: prefaulted plain block of "
TAKES_LINE = "preempt: host pool: the park takes the prefaulted plain block of "
PREFAULT_OFF = {"LLAMA_SERVER_PREEMPT_PREFAULT": "off"}
POOL_FAILED_LINE = "preempt: host pool allocation of "
RETURNED_LINE = "preempt: host pool: "  # "... MiB returned to the OS (...)"
HELD_RE = re.compile(
    r"host pool: (?:new|grown|prefaulted) \w+ block of ([0-9.]+) MiB"
    r"(?: in [0-9.]+ ms \(background[^)]*\))?, held ([0-9.]+) MiB of ([0-9.]+) MiB"
)

KV_TYPES = {
    "f16": ["-ctk", "f16", "-ctv", "f16"],
    "f32": ["-ctk", "f32", "-ctv", "f32"],
    "q8_0": ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
    # without flash attention the V cache is transposed: the serialization copies it row by row
    "f16-no-fa": ["-ctk", "f16", "-ctv", "f16", "-fa", "off"],
}


def settled_log(srv: Any) -> tuple[dict[str, float], str]:
    """Metrics once the server is idle, and its log once the idle pool's return to the OS is in
    it: the server logs from a thread of its own, so lines can reach the file after the reply."""
    m = assert_settled(srv.url)

    def returned() -> str | None:
        log: str = srv.log_text()
        return log if "returned to the OS (no request running)" in log else None

    return m, wait_for(returned, what="the pool's return to the OS in the log")


def draft_args(model: Path) -> list[str]:
    return ["-md", str(model), "--spec-type", "draft-simple", "--spec-draft-n-max", "4"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# every KV layout with and without a draft model, but the transposed V cache (flash attention
# off) only without: a draft changes nothing about how V is laid out
POOL_CASES = [
    pytest.param(kv, draft, id=f"{kv}-{'draft' if draft else 'no-draft'}")
    for kv in KV_TYPES
    for draft in (False, True)
    if not (draft and kv == "f16-no-fa")
]


@pytest.mark.parametrize(("kv", "draft"), POOL_CASES)
def test_forced_parks_through_the_pool_change_nothing(
    start_server: StartServer, tiny_model: Path, slow_model: Path, kv: str, draft: bool
) -> None:
    # q8_0 blocks are 32 wide: the tiny model's 16-wide heads cannot hold them, the slow model's can
    model, n_predict = (slow_model, 40) if kv == "q8_0" else (tiny_model, 64)
    args = [*BASE, *PARK, "-c", "512", "-np", "2", *KV_TYPES[kv]]
    if draft:
        args += draft_args(tiny_model)
    plain = start_server(model=model, args=args)
    forced = start_server(model=model, args=args, env={"LLAMA_SERVER_PREEMPT_EVERY": "8"})

    # prompts without greedy near-ties are picked where token probabilities are reported (not
    # under speculative decoding); without a draft the run that checked the prompt is the reference
    if draft:
        picker = start_server(model=model, args=[*BASE, "-c", "512", "-np", "1", *KV_TYPES[kv]])
        prompt = robust_prompts(picker.url, 1, 8, n_predict)[0]
        ref = complete(plain.url, prompt, n_predict)
    else:
        prompt, ref = robust_solo_completions(plain.url, 1, 8, n_predict)[0]
    got = complete(forced.url, prompt, n_predict)

    assert_same(got, ref, n_predict)
    min_parks = n_predict // 8 - 2
    assert got.preempt["parks"] >= min_parks, got.preempt
    assert got.preempt["recomputes"] == 0, got.preempt
    m, log = settled_log(forced)
    # a tiny model's state (target and draft) fits one 2 MiB block: it is prefaulted before the
    # first park, which takes it, and every later park reuses it
    pool_lines = [ln for ln in log.splitlines() if "host pool" in ln]
    assert log.count(PREFAULTED_LINE) == 1, pool_lines
    assert NEW_BLOCK_LINE not in log, pool_lines
    assert log.count(TAKES_LINE) == 1, pool_lines
    assert m["preempt_recompute_total"] == 0
    assert m["preempt_pool_bytes"] == 0
    assert RETURNED_LINE + "2.000 MiB returned to the OS (no request running)" in log


# prompt tokens for a state of 9-10 MiB on the slow model (about 48 KiB per cell in f32, 24 in
# f16, 12.6 in q8_0): just past the 8 MiB from which a copy is split, so that the prompt (most of
# each run's time) is no longer than the split needs
SPLIT_PROMPT = {"f16": 380, "f32": 200, "q8_0": 700, "f16-no-fa": 380}


@pytest.mark.slow
@pytest.mark.parametrize("kv", list(KV_TYPES))
def test_state_copies_split_over_threads_change_nothing(
    start_server: StartServer, slow_model: Path, kv: str
) -> None:
    """With two batch threads (-tb 2) a state of 8 MiB or more is copied in two
    shares at once, each cutting a K run or (flash attention off) the V rows wherever its bytes
    end; the restored slot must go on exactly as without parks."""
    args = [*BASE, *PARK, "-tb", "2", "-c", "2048", "-np", "2", *KV_TYPES[kv]]
    plain = start_server(model=slow_model, args=args)
    forced = start_server(model=slow_model, args=args, env={"LLAMA_SERVER_PREEMPT_EVERY": "8"})
    n_predict = 32
    # the run that checked the prompt for ties is the reference
    prompt, ref = robust_solo_completions(plain.url, 1, SPLIT_PROMPT[kv], n_predict)[0]

    got = complete(forced.url, prompt, n_predict)

    assert_same(got, ref, n_predict)
    assert got.preempt["parks"] >= n_predict // 8 - 2, got.preempt
    assert got.preempt["recomputes"] == 0, got.preempt
    sizes = [float(mib) for mib, _ in PARK_RE.findall(forced.log_text())]
    assert len(sizes) == got.preempt["parks"], sizes
    # every park was large enough for two shares of at least 4 MiB
    assert min(sizes) >= 8.0, sizes


# two parks of both slots at once (tokens 8 and 16): one swap and one recompute each
N_WITHIN = 24


@pytest.mark.slow
def test_pool_stays_within_preempt_ram(start_server: StartServer, slow_model: Path) -> None:
    # slow model: ~24 KiB per cell, so two ~100-cell states (~2.4 MiB each) do not fit 4 MiB;
    # the prompt cache (--cache-ram) is off so that the process RSS measures the parked states
    limit_mib = 4
    limit = limit_mib * 1024 * 1024
    srv = start_server(
        model=slow_model,
        args=[*BASE, "--preempt-ram", str(limit_mib), "-c", "512", "-np", "2", "--cache-ram", "0"],
        env={"LLAMA_SERVER_PREEMPT_EVERY": "8"},
    )
    prompts = [token_prompt(96, 11), token_prompt(96, 12)]
    assert srv.process is not None
    pid = srv.process.pid

    # the same workload once first: compute buffers (the recompute's re-prefill) and heap warm up,
    # and the pool's blocks must be gone again once the server is idle
    warm = complete_many(srv.url, prompts, N_WITHIN)
    assert all(c.ok for c in warm)
    assert assert_settled(srv.url)["preempt_pool_bytes"] == 0
    rss_base = rss_bytes(pid)
    n_log = len(srv.log_text())

    peak = {"rss": 0, "parked": 0.0, "pool": 0.0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["rss"] = max(peak["rss"], rss_bytes(pid))
            m = metrics(srv.url)
            peak["parked"] = max(peak["parked"], m["preempt_ram_bytes"])
            peak["pool"] = max(peak["pool"], m["preempt_pool_bytes"])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # both slots reach their 8th, 16th, ... token in the same iteration: both are parked at
        # once, and only one state fits the budget
        together = complete_many(srv.url, prompts, N_WITHIN)
    finally:
        done.set()
        sampler.join()
    assert all(c.ok and c.n_predicted == N_WITHIN for c in together), [c.error for c in together]

    log = srv.log_text()[n_log:]
    held = [(float(b), float(h), float(lim)) for b, h, lim in HELD_RE.findall(log)]
    assert held, "the pool allocated no block"
    for block, total, lim in held:
        assert lim == limit_mib, (block, total, lim)
        assert block <= total <= lim, (block, total, lim)
    assert peak["parked"] <= peak["pool"] <= limit, peak
    assert peak["pool"] > 0, "the gauge never showed the pool"
    # what the process maps for parked states stays within the budget (plus heap noise)
    assert peak["rss"] - rss_base <= limit + 8 * 1024 * 1024, (peak["rss"] - rss_base, limit)

    swaps = sum(c.preempt["parks"] - c.preempt["recomputes"] for c in together)
    recomputes = sum(c.preempt["recomputes"] for c in together)
    assert swaps >= 1, (swaps, recomputes)
    assert recomputes >= 1, (swaps, recomputes)

    m = assert_settled(srv.url)
    assert m["preempt_pool_bytes"] == 0
    assert "returned to the OS (no request running)" in srv.log_text()
    # the blocks went back to the OS, not to a heap that keeps them
    assert rss_bytes(pid) - rss_base <= 1024 * 1024, rss_bytes(pid) - rss_base


def test_failed_pool_allocation_parks_by_recompute(start_server: StartServer) -> None:
    args = [*BASE, *PARK, "-c", "512", "-np", "2"]
    srv = start_server(
        args=args,
        env={"LLAMA_SERVER_PREEMPT_EVERY": "8", "LLAMA_SERVER_PREEMPT_FAIL_POOL": "1"},
    )
    got = complete(srv.url, token_prompt(8, 5), 64)
    assert got.ok, got.error
    assert got.n_predicted == 64, got.error
    assert got.preempt["parks"] >= 6, got.preempt
    assert got.preempt["recomputes"] == got.preempt["parks"], got.preempt

    log = srv.log_text()
    assert "LLAMA_SERVER_PREEMPT_FAIL_POOL = 1" in log
    assert "background prefault off: a test knob fails host copies" in log
    assert PREFAULTING_LINE not in log
    failed = [ln for ln in log.splitlines() if POOL_FAILED_LINE in ln]
    assert len(failed) == got.preempt["parks"], failed
    why = "failed (LLAMA_SERVER_PREEMPT_FAIL_POOL), parking by recompute"
    assert all(why in ln for ln in failed)
    assert NEW_BLOCK_LINE not in log
    m = assert_settled(srv.url)
    assert m["preempt_recompute_total"] == m["n_preempt_total"] >= 6


@pytest.mark.slow
def test_a_growing_state_grows_its_block(start_server: StartServer, slow_model: Path) -> None:
    # slow model, ~24 KiB per cell: parked every 8 tokens from 72 to 128 cells, the state outgrows
    # its first block (1.7 MiB + 1/8 -> 2 MiB); the cached block grows instead of a new one. The
    # background prefault is off: it would size the block for the coming parks itself
    args = [*BASE, *PARK, "-c", "512", "-np", "2"]
    plain = start_server(model=slow_model, args=args)
    forced = start_server(
        model=slow_model, args=args, env={"LLAMA_SERVER_PREEMPT_EVERY": "8", **PREFAULT_OFF}
    )
    # the run that checked the prompt for ties is the reference
    prompt, ref = robust_solo_completions(plain.url, 1, 64, 64)[0]
    got = complete(forced.url, prompt, 64)

    assert_same(got, ref, 64)
    assert got.preempt["parks"] >= 6, got.preempt
    assert got.preempt["recomputes"] == 0, got.preempt
    log = forced.log_text()
    assert log.count(NEW_BLOCK_LINE) == 1, [ln for ln in log.splitlines() if "host pool" in ln]
    assert "preempt: host pool: grown plain block of " in log
    assert_settled(forced.url)


def first_lines(log: str, *markers: str) -> list[int]:
    """Index of the first log line holding each marker (-1 when none does)."""
    lines = log.splitlines()
    return [next((i for i, ln in enumerate(lines) if m in ln), -1) for m in markers]


def test_first_park_under_pressure_takes_a_prefaulted_block(start_server: StartServer) -> None:
    # two chats of 100 + 200 tokens overflow a 512-cell pool together: once what they hold and
    # will add passes 3/4 of the pool, a background thread faults in a block for the planner's
    # victim, and the first park of the busy period takes it instead of faulting in a new one
    srv = start_server(args=[*BASE, *PARK, "-c", "512", "-np", "2"])
    got = complete_many(srv.url, [token_prompt(100, 21), token_prompt(100, 22)], 200)
    assert all(c.ok and c.n_predicted == 200 for c in got), [c.error for c in got]
    assert sum(c.preempt["parks"] for c in got) >= 1, [c.preempt for c in got]
    assert all(c.preempt["recomputes"] == 0 for c in got), [c.preempt for c in got]

    m, log = settled_log(srv)
    pool_lines = [ln for ln in log.splitlines() if "host pool" in ln or "preempted: " in ln]
    assert "background prefault on" in log
    i_start, i_ready, i_take, i_park = first_lines(
        log, PREFAULTING_LINE, PREFAULTED_LINE, TAKES_LINE, "preempted: "
    )
    assert 0 <= i_start < i_ready < i_take < i_park, pool_lines
    assert "(the pool is filling;" in log.splitlines()[i_start], pool_lines
    assert NEW_BLOCK_LINE not in log, pool_lines
    assert m["preempt_pool_bytes"] == 0


def test_an_unused_prefaulted_block_goes_back_when_idle(start_server: StartServer) -> None:
    # two chats of 100 + 100 tokens fill a 512-cell pool to 400 cells: past 3/4 of it a block is
    # prefaulted for a park that never comes, and the idle server returns it (or cancels the
    # prefault if it is still under way)
    srv = start_server(args=[*BASE, *PARK, "-c", "512", "-np", "2"])
    got = complete_many(srv.url, [token_prompt(100, 21), token_prompt(100, 22)], 100)
    assert all(c.ok and c.n_predicted == 100 for c in got), [c.error for c in got]
    assert all(c.preempt["parks"] == 0 for c in got), [c.preempt for c in got]
    # an idle server gives its blocks back (and cancels a prefault) at the latest when /metrics
    # is asked
    m, log = settled_log(srv)
    assert PREFAULTING_LINE + "2.000 MiB in the background (the pool is filling;" in log
    assert m["preempt_pool_bytes"] == 0, m
    assert m["n_preempt_total"] == 0, m
    assert RETURNED_LINE + "2.000 MiB returned to the OS (no request running)" in log


def test_prefault_off_knob(start_server: StartServer) -> None:
    srv = start_server(
        args=[*BASE, *PARK, "-c", "512", "-np", "2"],
        env={"LLAMA_SERVER_PREEMPT_EVERY": "8", **PREFAULT_OFF},
    )
    got = complete(srv.url, token_prompt(8, 5), 32)
    assert got.ok, got.error
    assert got.preempt["parks"] >= 2, got.preempt
    _, log = settled_log(srv)
    assert "background prefault off: LLAMA_SERVER_PREEMPT_PREFAULT=off" in log
    assert PREFAULTING_LINE not in log
    assert log.count(NEW_BLOCK_LINE) == 1

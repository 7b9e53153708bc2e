"""KV preemption: park, restore, the planner and the last resort (docs/preemption.md).

Every test runs the built server with a generated random-weight model. Generations use greedy
sampling with `ignore_eos`, so a request produces exactly `n_predict` tokens, and concurrent
streams that fit the pool produce exactly the tokens of their solo runs: "identical to the solo
run" is therefore a fair test of a park. Prompts are token lists of known length.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BASE,
    CONTEXT_ERROR,
    LAST_RESORT_LINE,
    ON_REQUEST_LINE,
    PARK,
    PARK_LINE,
    RESUME_LINE,
    REWIND_LINE,
    ROTATE_NOW,
    ROTATION_LINE,
    Completion,
    RawStream,
    complete,
    complete_many,
    count_lines,
    metrics,
    n_decoded_max,
    preempt_log_lines,
    robust_prompts,
    slots,
    token_prompt,
    wait_for,
    wait_settled,
)

pytestmark = [pytest.mark.server]


PROMPTS = [token_prompt(8, seed) for seed in range(4)]


def assert_settled(url: str) -> dict[str, float]:
    """After a pressure run: every park resumed, nothing parked, no host RAM held."""
    m = wait_settled(url)
    assert m["requests_preempted"] == 0
    assert m["preempt_ram_bytes"] == 0
    assert m["n_resume_total"] == m["n_preempt_total"], m
    return m


def assert_same(got: Completion, ref: Completion, n: int) -> None:
    assert ref.ok, ref.error
    assert got.ok, got.error
    assert got.n_predicted == n, (got.n_predicted, ref.n_predicted)
    assert ref.n_predicted == n, (got.n_predicted, ref.n_predicted)
    assert len(got.tokens) == n  # byte tokens are banned, so every token is streamed
    assert got.tokens == ref.tokens
    assert got.content == ref.content


def solo_then_together(
    url: str, prompts: list[list[int]], n_predict: int
) -> tuple[list[Completion], list[Completion]]:
    """Each prompt alone, then all of them in one request (their tasks start in the same iteration,
    however fast the model is)."""
    solo = [complete(url, p, n_predict) for p in prompts]
    together = complete_many(url, prompts, n_predict)
    return solo, together


# 1 ---------------------------------------------------------------------------------------------


def test_forced_parks_change_nothing(start_server: StartServer) -> None:
    args = [*BASE, *PARK, "-c", "512", "-np", "2"]
    plain = start_server(args=args)
    forced = start_server(args=args, env={"LLAMA_SERVER_PREEMPT_EVERY": "8"})

    prompt = robust_prompts(plain.url, 1, 8, 64)[0]
    ref = complete(plain.url, prompt, 64)
    got = complete(forced.url, prompt, 64)

    assert_same(got, ref, 64)
    assert ref.preempt == {"parks": 0, "recomputes": 0}
    assert got.preempt["parks"] >= 6, got.preempt
    assert got.preempt["recomputes"] == 0, got.preempt

    log = forced.log_text()
    assert "test knobs on (--preempt-test-knobs)" in log
    assert "LLAMA_SERVER_PREEMPT_EVERY = 8" in log
    assert count_lines(log, ON_REQUEST_LINE) >= 6
    assert count_lines(log, PARK_LINE) >= 6
    assert count_lines(log, RESUME_LINE) >= 6
    m = assert_settled(forced.url)
    assert m["n_preempt_total"] >= 6
    assert m["preempt_recompute_total"] == 0
    assert not preempt_log_lines(plain.log_text())


def test_knobs_need_the_switch(start_server: StartServer) -> None:
    """The test knobs are read only with --preempt-test-knobs: without it, a server given all
    seven parks nothing and fails nothing, and its log names each one as ignored."""
    knobs = {
        "LLAMA_SERVER_PREEMPT_EVERY": "8",
        "LLAMA_SERVER_PREEMPT_PLANNER": "off",
        "LLAMA_SERVER_PREEMPT_FAIL_SAVE": "1",
        "LLAMA_SERVER_PREEMPT_ROTATE_S": "0",
        "LLAMA_SERVER_PREEMPT_FAIL_POOL": "1",
        "LLAMA_SERVER_PREEMPT_PREFAULT": "off",
        "LLAMA_SERVER_PREEMPT_FAIL_SHIFT": "1",
    }
    args = [*BASE, *PARK, "-c", "512", "-np", "2"]
    plain = start_server(args=args)
    srv = start_server(args=args, env=knobs, test_knobs=False)

    prompt = robust_prompts(plain.url, 1, 8, 64)[0]
    ref = complete(plain.url, prompt, 64)
    got = complete(srv.url, prompt, 64)

    assert_same(got, ref, 64)
    assert got.preempt == {"parks": 0, "recomputes": 0}
    log = srv.log_text()
    for name in knobs:
        assert f"{name} is ignored: test knobs are read only with --preempt-test-knobs" in log
        assert f"{name} = " not in log
    assert "test knobs on" not in log
    assert "background prefault on" in log
    assert not preempt_log_lines(log)
    m = assert_settled(srv.url)
    assert m["n_preempt_total"] == 0


# 2 ---------------------------------------------------------------------------------------------


def test_two_overflowing_generations_both_finish(start_server: StartServer) -> None:
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "2"])
    solo, together = solo_then_together(srv.url, robust_prompts(srv.url, 2, 8, 160), 160)

    for got, ref in zip(together, solo, strict=True):
        assert_same(got, ref, 160)
        assert got.final
        assert not got.final["truncated"]
    assert sum(c.preempt["parks"] for c in together) >= 1
    m = assert_settled(srv.url)
    assert m["n_preempt_total"] >= 1
    assert count_lines(srv.log_text(), PARK_LINE) == m["n_preempt_total"]


# 3 ---------------------------------------------------------------------------------------------


def test_last_resort_without_planner(start_server: StartServer) -> None:
    srv = start_server(
        args=[*BASE, *PARK, "-c", "256", "-np", "2"], env={"LLAMA_SERVER_PREEMPT_PLANNER": "off"}
    )
    solo, together = solo_then_together(srv.url, robust_prompts(srv.url, 2, 8, 160), 160)
    for got, ref in zip(together, solo, strict=True):
        assert_same(got, ref, 160)
    log = srv.log_text()
    assert "LLAMA_SERVER_PREEMPT_PLANNER = off" in log
    assert count_lines(log, LAST_RESORT_LINE) >= 1
    assert count_lines(log, LAST_RESORT_LINE) == count_lines(log, PARK_LINE)
    assert_settled(srv.url)


def test_last_resort_rewinds_a_prompt_chunk_once(start_server: StartServer) -> None:
    """Two long prompts prefilled in 64-token chunks fill the pool exactly; the next step (one
    generated token plus the other prompt's next chunk) cannot fit even one token, so the last
    resort rewinds and parks the prompt in progress. Its chunk is processed exactly once."""
    srv = start_server(
        args=[*BASE, *PARK, "-c", "256", "-np", "2", "-b", "64", "-ub", "64"],
        env={"LLAMA_SERVER_PREEMPT_PLANNER": "off"},
    )
    prompts = [*robust_prompts(srv.url, 1, 200, 40), *robust_prompts(srv.url, 1, 150, 40)]
    solo, together = solo_then_together(srv.url, prompts, 40)
    for got, ref, p in zip(together, solo, prompts, strict=True):
        assert_same(got, ref, 40)
        assert got.final is not None
        assert got.final["tokens_evaluated"] == len(p)
        assert got.timings["prompt_n"] == len(p), got.timings
        assert got.timings["cache_n"] == 0
    assert sum(c.preempt["parks"] for c in together) >= 1
    log = srv.log_text()
    assert count_lines(log, LAST_RESORT_LINE) >= 1
    assert any(
        REWIND_LINE in ln and "back to prompt processing" in ln for ln in log.splitlines()
    ), "no prompt chunk was rewound"
    assert_settled(srv.url)


# 4 ---------------------------------------------------------------------------------------------


def overflow_outcome(url: str) -> list[tuple[int, str]]:
    together = complete_many(url, PROMPTS[:2], 160)
    assert all(c.final is None for c in together)
    return [(c.status, c.error_message) for c in together]


@pytest.mark.stock
def test_off_by_default_behaves_as_upstream(
    start_server: StartServer, stock_server_bin: Path
) -> None:
    patched = start_server(args=[*BASE, "-c", "256", "-np", "2"])
    stock = start_server(args=[*BASE, "-c", "256", "-np", "2"], binary=stock_server_bin)

    got = overflow_outcome(patched.url)
    want = overflow_outcome(stock.url)
    assert [e for _, e in want] == [CONTEXT_ERROR, CONTEXT_ERROR], want  # the failure being fixed
    assert got == want

    assert not preempt_log_lines(patched.log_text())
    m = metrics(patched.url)
    assert m["n_preempt_total"] == 0
    assert m["n_resume_total"] == 0
    assert m["requests_preempted"] == 0

    # the server lives on and serves the next request; no "preempt" record while preemption is off
    after = complete(patched.url, PROMPTS[2], 16, stream=False)
    assert after.ok
    assert after.n_predicted == 16
    assert after.final is not None
    assert "preempt" not in after.final
    assert all("is_preempted" not in s for s in slots(patched.url))


# 5 ---------------------------------------------------------------------------------------------


def assert_recompute_run(
    url: str, together: list[Completion], n_predict: int, prompt_len: int
) -> None:
    for c in together:
        assert c.ok, c.error
        assert c.n_predicted == n_predict
        assert len(c.tokens) == n_predict
        assert c.preempt["recomputes"] == c.preempt["parks"]
        # the replay is never billed: usage and timings count the task's own prompt only
        assert c.final is not None
        assert c.final["tokens_evaluated"] == prompt_len
        assert c.timings["prompt_n"] + c.timings["cache_n"] == prompt_len, c.timings
        assert c.timings["predicted_n"] == n_predict
    assert sum(c.preempt["parks"] for c in together) >= 1
    m = assert_settled(url)
    assert m["preempt_recompute_total"] == m["n_preempt_total"] >= 1


@pytest.mark.slow
def test_recompute_above_the_ram_budget(start_server: StartServer, slow_model: Path) -> None:
    # the slow model's cells are ~24 KiB: a parked sequence of ~100 cells does not fit 1 MiB.
    # Two 100-token prompts fill the pool a few dozen tokens in: few tokens of the slow model
    srv = start_server(
        model=slow_model, args=[*BASE, "--preempt-ram", "1", "-c", "256", "-np", "2"]
    )
    together = complete_many(srv.url, [token_prompt(100, 20), token_prompt(100, 21)], 48)
    assert_recompute_run(srv.url, together, 48, 100)
    assert "recompute on resume" in srv.log_text()


def test_recompute_when_the_host_copy_fails(start_server: StartServer) -> None:
    srv = start_server(
        args=[*BASE, *PARK, "-c", "256", "-np", "2"], env={"LLAMA_SERVER_PREEMPT_FAIL_SAVE": "1"}
    )
    together = complete_many(srv.url, PROMPTS[:2], 160)
    assert_recompute_run(srv.url, together, 160, 8)
    assert "to re-prefill" in srv.log_text()


# 6 ---------------------------------------------------------------------------------------------


def test_two_near_full_prompts(start_server: StartServer) -> None:
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "2"])
    prompts = [token_prompt(240, 10), token_prompt(240, 11)]
    together = complete_many(srv.url, prompts, 8)
    for c in together:
        assert c.ok, c.error
        assert c.n_predicted == 8
        assert c.final is not None
        assert c.final["tokens_evaluated"] == 240
        assert c.timings["prompt_n"] == 240, c.timings
    assert sum(c.preempt["parks"] for c in together) >= 1
    assert_settled(srv.url)


# 7 ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cancel_while_parked_frees_ram_and_slot(
    start_server: StartServer, slow_model: Path
) -> None:
    # A (priority 1: the leader, never rotated out) shifts its context instead of ending, so it
    # runs until the test cuts it; B's long prompt fits beside A's first tokens and B is parked a
    # few tokens later with ~200 cells, more than A's shifts free
    srv = start_server(
        model=slow_model, args=[*BASE, *PARK, "-c", "256", "-np", "2", "--context-shift"]
    )
    results: dict[str, Completion] = {}
    stop = threading.Event()

    def run_a() -> None:
        results["a"] = complete(srv.url, PROMPTS[0], 100_000, priority=1, cancel_event=stop)

    ta = threading.Thread(target=run_a, daemon=True)
    ta.start()
    wait_for(lambda: n_decoded_max(srv.url) >= 2, what="A generating")
    b = RawStream(srv.url, token_prompt(180, 1), 40)

    parked = wait_for(
        lambda: [s for s in slots(srv.url) if s.get("is_preempted")],
        timeout=60,
        what="a parked slot",
    )
    assert parked[0]["n_preempt"] >= 1
    assert parked[0]["is_processing"]
    m = metrics(srv.url)
    assert m["requests_preempted"] == 1
    assert m["preempt_ram_bytes"] > 0

    b.cancel()  # the client goes away while its slot is parked
    m = wait_for(
        lambda: (lambda m: m if m["preempt_dropped_total"] == 1 else None)(metrics(srv.url)),
        timeout=10,
        what="the parked request to be dropped",
    )
    assert m["requests_preempted"] == 0
    assert m["preempt_ram_bytes"] == 0
    assert "a" not in results, "A should still be running while B's cancel is handled"
    busy = [s for s in slots(srv.url) if s["is_processing"]]
    assert len(busy) == 1
    assert not busy[0]["is_preempted"]

    # A carries on after the drop, then its client goes
    n_a = n_decoded_max(srv.url)
    wait_for(lambda: n_decoded_max(srv.url) >= n_a + 4, what="A generating after the drop")
    stop.set()
    ta.join(60)
    assert results["a"].status == 200
    assert results["a"].error is None, results["a"].error
    assert results["a"].n_events > n_a
    after = complete(srv.url, PROMPTS[2], 16)
    assert after.ok
    assert after.n_predicted == 16
    m = wait_settled(srv.url)
    assert m["n_resume_total"] + m["preempt_dropped_total"] == m["n_preempt_total"]
    assert m["preempt_ram_bytes"] == 0


# 8 ---------------------------------------------------------------------------------------------


def test_real_overflows_get_the_context_error(start_server: StartServer) -> None:
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "2"])

    # a prompt larger than the pool
    big = complete(srv.url, token_prompt(300, 5), 8, stream=False)
    assert big.status == 400
    assert big.error is not None
    assert big.error["type"] == "exceed_context_size_error", big.error

    # an n_cmpl > 1 family that overflows the pool alone: parking it (whole) cannot help
    r = httpx.post(
        f"{srv.url}/completion",
        timeout=120,
        json={
            "prompt": PROMPTS[0],
            "n_predict": 200,
            "n_cmpl": 2,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": False,
        },
    )
    assert r.status_code != 200
    assert CONTEXT_ERROR in r.text

    m = metrics(srv.url)
    assert m["n_preempt_total"] == 0
    assert not preempt_log_lines(srv.log_text())
    after = complete(srv.url, PROMPTS[1], 16)
    assert after.ok
    assert after.n_predicted == 16


# 9 ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rotation_with_context_shift(start_server: StartServer) -> None:
    # the head of the parked line waits ROTATE_NOW (0 s instead of 2) before a resident that has
    # shifted is rotated out: a rotation then comes with the first shift after a park, however
    # fast the model is, and generations longer than the pool see many (about 150 for three of
    # 300 tokens on 256 cells)
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "3", "--context-shift"],
                       env=ROTATE_NOW)
    n = 300
    together = complete_many(srv.url, PROMPTS[:3], n)
    for c in together:
        assert c.ok, c.error
        assert c.n_predicted == n
    log = srv.log_text()
    assert count_lines(log, ROTATION_LINE) >= 1, "no rotation happened"
    assert_settled(srv.url)


# 10 --------------------------------------------------------------------------------------------


def test_four_chats_overflow_four_slots(start_server: StartServer) -> None:
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "4"])
    solo, together = solo_then_together(srv.url, robust_prompts(srv.url, 4, 8, 100), 100)
    for got, ref in zip(together, solo, strict=True):
        assert_same(got, ref, 100)
    assert sum(c.preempt["parks"] for c in together) >= 1
    assert_settled(srv.url)


# 11 --------------------------------------------------------------------------------------------


def soak(
    url: str, n_requests: int, seed: int, n_ctx: int
) -> list[tuple[dict[str, int], Completion]]:
    rng = random.Random(seed)
    plans = []
    for i in range(n_requests):
        prompt_len = rng.choice([rng.randint(1, 40), rng.randint(40, 160), rng.randint(160, 250)])
        if rng.random() < 0.03:
            prompt_len = rng.randint(n_ctx, n_ctx + 40)  # cannot fit even alone
        plans.append(
            {
                "prompt_len": prompt_len,
                "n_predict": rng.randint(1, 64),
                "stream": rng.random() < 0.7,
                "cancel_after": rng.randint(1, 20) if rng.random() < 0.15 else None,
                "seed": seed * 100_000 + i,
            }
        )

    def one(plan: dict[str, int]) -> Completion:
        return complete(
            url,
            token_prompt(plan["prompt_len"], plan["seed"]),
            plan["n_predict"],
            stream=bool(plan["stream"]) or plan["cancel_after"] is not None,
            cancel_after_events=plan["cancel_after"],
            timeout=300,
        )

    out: list[tuple[dict[str, int], Completion]] = []
    lock = threading.Lock()
    queue = list(plans)

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                plan = queue.pop(0)
            res = one(plan)
            with lock:
                out.append((plan, res))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def check_soak(
    srv_url: str,
    alive: bool,
    results: list[tuple[dict[str, int], Completion]],
    n_requests: int,
    n_ctx: int,
) -> None:
    assert alive, "the server died"
    assert len(results) == n_requests
    for plan, c in results:
        fits_alone = plan["prompt_len"] < n_ctx
        if c.cancelled:
            continue
        if fits_alone:
            assert c.ok, (plan, c.status, c.error)
            assert c.final is not None
            assert c.final["tokens_evaluated"] == plan["prompt_len"]
            # without context shift a slot stops when its cells reach its context (the pool)
            assert c.n_predicted == min(plan["n_predict"], n_ctx - plan["prompt_len"]), (
                plan,
                c.final,
            )
        else:
            assert c.status == 400, (plan, c.status, c.error)
            assert c.error is not None, (plan, c.status, c.error)
            assert c.error["type"] == "exceed_context_size_error"
    m = wait_settled(srv_url, timeout=60)
    assert m["requests_preempted"] == 0
    assert m["preempt_ram_bytes"] == 0
    assert m["n_resume_total"] + m["preempt_dropped_total"] == m["n_preempt_total"], m
    assert m["n_preempt_total"] >= 1, "the soak never overflowed the pool"


def run_soak(start_server: StartServer, n_requests: int, seed: int) -> None:
    n_ctx = 256
    srv = start_server(args=[*BASE, *PARK, "-c", str(n_ctx), "-np", "4"])
    t0 = time.monotonic()
    results = soak(srv.url, n_requests, seed, n_ctx)
    check_soak(srv.url, srv.alive(), results, n_requests, n_ctx)
    n_cancel = sum(1 for _, c in results if c.cancelled)
    assert n_cancel >= 1
    print(f"soak: {n_requests} requests, {n_cancel} cancelled, {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
def test_seeded_soak(start_server: StartServer) -> None:
    # 100 requests of seed 7, six at a time on 256 cells: 20 the client may cut, 5 that cannot fit
    run_soak(start_server, 100, seed=7)

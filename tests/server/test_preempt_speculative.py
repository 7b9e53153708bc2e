"""KV preemption with speculative decoding (a draft model).

A park drops the slot's pending draft (a prediction, not a result) and saves and restores the
draft context's sequence together with the target's. The tiny model drafts for itself here,
so drafts are accepted and every verify step carries several tokens: a park that mishandled
the draft state would change the tokens or break the verify batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BASE,
    PARK,
    PARK_LINE,
    complete,
    complete_many,
    robust_prompts,
    token_prompt,
)
from tests.server.test_preempt_kv import assert_same, assert_settled, solo_then_together

pytestmark = [pytest.mark.server]


def draft_args(model: Path) -> list[str]:
    return ["-md", str(model), "--spec-type", "draft-simple", "--spec-draft-n-max", "4"]


def robust(start_server: StartServer, count: int, n_predict: int) -> list[list[int]]:
    """Prompts without greedy near-ties, picked on a server without a draft model (token
    probabilities are not reported under speculative decoding; the greedy path is the same)."""
    picker = start_server(args=[*BASE, "-c", "512", "-np", "1"])
    prompts = robust_prompts(picker.url, count, 8, n_predict)
    picker.stop()
    return prompts


def drafted(c: object) -> int:
    timings = getattr(c, "timings", None) or {}
    return int(timings.get("draft_n", 0))


def test_forced_parks_with_a_draft_model_change_nothing(start_server: StartServer,
                                                        tiny_model: Path) -> None:
    args = [*BASE, *PARK, "-c", "512", "-np", "2", *draft_args(tiny_model)]
    plain = start_server(args=args)
    forced = start_server(args=args, env={"LLAMA_SERVER_PREEMPT_EVERY": "8"})
    prompt = robust(start_server, 1, 64)[0]

    ref = complete(plain.url, prompt, 64)
    got = complete(forced.url, prompt, 64)

    assert_same(got, ref, 64)
    assert drafted(ref) > 0, "speculative decoding was not active"
    assert drafted(got) > 0, "speculative decoding was not active"
    assert got.preempt["parks"] >= 6, got.preempt
    assert got.preempt["recomputes"] == 0, got.preempt
    assert_settled(forced.url)


def test_overflowing_generations_with_a_draft_model(start_server: StartServer,
                                                    tiny_model: Path) -> None:
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "2", *draft_args(tiny_model)])
    solo, together = solo_then_together(srv.url, robust(start_server, 2, 160), 160)

    for got, ref in zip(together, solo, strict=True):
        assert_same(got, ref, 160)
        assert drafted(got) > 0
    assert sum(c.preempt["parks"] for c in together) >= 1
    m = assert_settled(srv.url)
    assert m["n_preempt_total"] >= 1
    assert srv.log_text().count(PARK_LINE) >= 1


def test_a_last_resort_in_a_shift_s_iteration_neither_saves_nor_recomputes(
    start_server: StartServer, tiny_model: Path,
) -> None:
    """A context shift reaches the draft context only when it mirrors a batch the target
    decoded, so after a refused decode (the last resort's case) the draft's shift is still
    pending: saved then, its K would come back unrotated. Such a slot was once parked by
    recompute instead, but a slot that has shifted is never recomputed (its kept cells carry
    what the discarded tokens contributed; a replay changed its answer): it can be neither
    saved nor recomputed, so the last resort rebuilds the batch once for that shift before it
    parks anything, and the decode that succeeds applies the shift to the draft. The window
    cannot be timed from outside, so LLAMA_SERVER_PREEMPT_FAIL_SHIFT refuses the decode that
    applies each shift. A (40 prompt tokens) and B (8) are two prompts of one request, so they
    start in the same iteration however fast the model is, and each generates 115 tokens: A
    shifts once at the per-slot limit of 128 while B (123 cells at its end) runs and never
    shifts. B then holds more cells than A's halved sequence and leads: A, in the window, is the
    one the last resort would park."""
    per_slot = ["--kv-unified-per-slot", "128", "--context-shift"]
    args = [*BASE, *PARK, "-c", "512", "-np", "2", *per_slot, *draft_args(tiny_model)]
    srv = start_server(args=args, env={"LLAMA_SERVER_PREEMPT_FAIL_SHIFT": "1"})
    n = 115
    a, b = complete_many(srv.url, [token_prompt(40, 31), token_prompt(8, 32)], n)

    assert a.ok, a.error
    assert b.ok, b.error
    assert a.n_predicted == n
    assert b.n_predicted == n
    assert drafted(a) > 0, "speculative decoding was not active"
    log = srv.log_text()
    assert "the decode that applied a context shift is refused" in log, "no shift was refused"
    assert "a draft context has not applied a context shift yet, the batch is rebuilt" in log
    assert b.preempt["parks"] == 0, b.preempt
    # neither saved with unrotated draft K nor recomputed after its shift
    assert a.preempt == {"parks": 0, "recomputes": 0}, a.preempt
    assert_settled(srv.url)

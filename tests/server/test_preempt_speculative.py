"""KV preemption with speculative decoding (a draft model): issue 4's scope.

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
    robust_prompts,
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

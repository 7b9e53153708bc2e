"""Regression tests for the defects a line-by-line review of the first series found (KV
preemption must never lose context).

Each test is the review's reproducer, made independent of the model's speed where it used a
fixed delay: a request is sent when the server reports the state the reproducer needs (read from
/slots), not after a sleep. Those run the "slow" generated model: the tiny one generates a few
hundred tokens in a fraction of a second, shorter than a /slots poll on a busy machine. Every one
of them failed on the series before the fix (see docs/preemption.md, "Testing", for what each
showed).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
import pytest

from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BAN_BYTE_TOKENS,
    BASE,
    LAST_RESORT_LINE,
    PARK,
    completion_body,
    count_lines,
    metrics,
    run_concurrently,
    slots,
    token_prompt,
    wait_for,
    wait_settled,
)
from tests.server.test_preempt_fuzz import Response, check_notices, parse_stream, post
from tests.server.test_preempt_kv import assert_same, solo_then_together
from tests.support.llama import LlamaServer, ServerDied
from tests.support.sse_client import StreamLog, stream_sse

pytestmark = [pytest.mark.server]

T = TypeVar("T")


def body(prompt: list[int] | list[list[int]], n_predict: int, **extra: Any) -> dict[str, Any]:
    """The suite's greedy, byte-token-free completion body, streamed unless told otherwise."""
    return completion_body(prompt, n_predict, **{"stream": True, **extra})


class Notices:
    """Minimal stand-in for a RequestPlan for check_notices()."""

    def __init__(self, names_notices: bool) -> None:
        self.names_notices = names_notices


def streamed(url: str, b: dict[str, Any]) -> Response:
    return post(url, "/completion", b, None)


def generating(url: str, n_decoded: int, n_slots: int = 1) -> bool:
    busy = [s for s in slots(url) if s["is_processing"] and not s.get("is_preempted")]
    return sum(1 for s in busy if s["next_token"][0]["n_decoded"] >= n_decoded) >= n_slots


class Background(Generic[T]):
    """fn() on a thread; result() joins it and returns what fn returned (or raises what it
    raised)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.out: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self.out["res"] = fn()
        except BaseException as e:  # surfaced by result()
            self.out["err"] = e

    def result(self, timeout: float = 300.0) -> T:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"no answer after {timeout:.0f} s"
        if "err" in self.out:
            raise self.out["err"]
        return self.out["res"]  # type: ignore[no-any-return]


def grown_alone(srv: LlamaServer, fn: Callable[[], T], n_prompt: int, holding: int,
                what: str = "A", n_slots: int = 1) -> Background[T]:
    """Starts A (fn, whose prompt is `n_prompt` tokens) in the background and returns once its
    slot (its `n_slots` slots) holds `holding` cells, the rest generated (a size read from
    /slots, not a delay). Most of A's size is its prompt: a prompt token costs a fraction of a
    generated one, and from the next request's arrival on, the two are what they were with a
    short prompt and a long answer."""
    a = Background(fn)
    wait_for(lambda: generating(srv.url, holding - n_prompt, n_slots),
             what=f"{what} holding {holding} cells", timeout=240)  # a condition, not a time limit
    return a


def park_a_pair(srv: LlamaServer) -> Background[list[StreamLog]]:
    """Two streams that overflow a 256-cell pool together: A (116 prompt tokens, 92 generated)
    and B (96 and 24). They fill it after about 17 tokens each; B, the smaller, is parked while
    A generates its last 75 or so (A ends at 208 cells: a small request still fits beside it),
    and comes back for its last few when A ends. Returns once a slot is parked; the result is
    [A, B]."""
    def one(prompt: list[int], n_predict: int) -> Callable[[], StreamLog]:
        body = completion_body(prompt, n_predict, stream=True)
        return lambda: stream_sse(f"{srv.url}/completion", body)

    pair = Background(lambda: run_concurrently([one(token_prompt(116, 50), 92),
                                                one(token_prompt(96, 51), 24)]))
    wait_for(lambda: any(s.get("is_preempted") for s in slots(srv.url)), what="a parked slot",
             timeout=240)  # a condition, not a time limit
    return pair


def assert_complete(res: Response, n_results: int, prompt_lens: list[int], n_predict: int,
                    multi_prompt: bool, family: bool = False) -> dict[int, dict[str, Any]]:
    assert res.status == 200, res.body[:400]
    finals, error, tokens = parse_stream(res)
    assert error is None, error
    assert sorted(finals) == list(range(n_results)), sorted(finals)
    for idx, final in finals.items():
        n_prompt = prompt_lens[idx] if multi_prompt else prompt_lens[0]
        assert final["tokens_predicted"] == n_predict, (idx, final["tokens_predicted"])
        assert final["tokens_cached"] == n_prompt + n_predict - 1, (idx, final["tokens_cached"])
        assert len(tokens[idx]) == n_predict
    # several prompts, or an n_cmpl family: the notices name the result
    check_notices(Notices(multi_prompt or family), res)  # type: ignore[arg-type]
    return finals


# a re-parked replay, and its size after a recompute restore -----------------------------------


def test_reparked_replay_keeps_what_is_left(start_server: StartServer) -> None:
    """Recompute parks with small batches: a slot re-filling after a recompute park is parked
    again before its refill ends. It must resume the rest of its refill, not lose it (the review
    saw index 0 end with tokens_cached=208 instead of 247, the response saying nothing)."""
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "4", "-b", "8", "-ub", "8"],
                       env={"LLAMA_SERVER_PREEMPT_FAIL_SAVE": "1"})
    prompts = [token_prompt(8, seed) for seed in range(4)]
    res = streamed(srv.url, body(prompts, 240))
    finals = assert_complete(res, 4, [8] * 4, 240, multi_prompt=True)
    assert sum(f["preempt"]["recomputes"] for f in finals.values()) >= 1
    m = wait_settled(srv.url)
    assert m["n_resume_total"] == m["n_preempt_total"] == m["preempt_recompute_total"]


RESUME_RECOMPUTE = re.compile(
    r"resumed after [0-9.]+ s: recompute, (\d+) tokens to re-prefill, kv (\d+)/")


def test_recompute_restore_keeps_the_slot_size(start_server: StartServer) -> None:
    """Defect 2: a slot restored by recompute still holds its whole sequence as far as the planner
    is concerned (its replay), or the same pass restores more parked slots into room it needs and
    parks again. The restore's log line reports the pool's use with the slot back in: it must
    count the tokens about to be re-prefilled (before the fix it said "kv 0/256" for a slot with
    123 tokens to re-prefill)."""
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "4", "-b", "8", "-ub", "8"],
                       env={"LLAMA_SERVER_PREEMPT_FAIL_SAVE": "1"})
    prompts = [token_prompt(8, seed) for seed in range(4)]
    res = streamed(srv.url, body(prompts, 200))
    restores = [(int(m.group(1)), int(m.group(2)))
                for m in map(RESUME_RECOMPUTE.search, srv.log_text().splitlines()) if m]
    assert restores, "no restore by recompute"
    for n_replay, used in restores:
        assert used >= n_replay, f"{n_replay} tokens to re-prefill, but the pool counted {used}"
    assert_complete(res, 4, [8] * 4, 200, multi_prompt=True)


# a family and parking ------------------------------------------------------------------------


def test_an_n_cmpl_family_does_not_block_parking(start_server: StartServer,
                                                 slow_model: Path) -> None:
    """A (a 420-token prompt) generates alone; B (an n_cmpl 2 family) arrives when A holds 428
    cells. Each fits alone (488 and 128 cells of 512), together they do not: something must be
    parked, and both must complete (before the fix nothing was parkable and both streams died
    with the context error)."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "512", "-np", "3"])
    a = grown_alone(srv, lambda: streamed(srv.url, body(token_prompt(420, 1), 68)), 420, 428)
    b = streamed(srv.url, body(token_prompt(8, 2), 60, n_cmpl=2))
    assert_complete(b, 2, [8], 60, multi_prompt=False, family=True)
    assert_complete(a.result(), 1, [420], 68, multi_prompt=False)
    m = wait_settled(srv.url)
    assert m["n_preempt_total"] >= 1
    assert m["n_resume_total"] == m["n_preempt_total"]


# a stale n_cmpl child ------------------------------------------------------------------------


@pytest.mark.parametrize("preempt", [False, True], ids=["preempt-off", "preempt-on"])
def test_n_cmpl_child_with_stale_cells(start_server: StartServer, preempt: bool) -> None:
    """An n_cmpl child given a slot that still caches the previous request's cells. Stock
    llama-server answers "Invalid input batch." (500); the series' n_cmpl child patch fixes it."""
    args = [*BASE, "-c", "256", "-np", "2", "-b", "512", "-ub", "512"]
    srv = start_server(args=[*args, *(PARK if preempt else [])])
    first = streamed(srv.url, body(token_prompt(8, 3), 248, cache_prompt=True))
    assert_complete(first, 1, [8], 248, multi_prompt=False)
    second = streamed(srv.url, body(token_prompt(100, 4), 20, n_cmpl=2, cache_prompt=True))
    assert_complete(second, 2, [100], 20, multi_prompt=False, family=True)
    r = httpx.post(f"{srv.url}/completion", timeout=120,
                   json=body(token_prompt(100, 5), 20, n_cmpl=2, cache_prompt=True, stream=False))
    assert r.status_code == 200, r.text[:400]


# defects 12 and 6 ----------------------------------------------------------------------------


def test_no_unpaired_park_when_a_sibling_ends_the_stream(start_server: StartServer,
                                                        slow_model: Path) -> None:
    """Two prompts in one stream, then an n_cmpl family: the pool overflows while a prompt of
    the first request is parked. Every `: preempted` of the stream must be paired, whatever ends
    it (before the fix, an error of one prompt ended the stream with its sibling still parked)."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "512", "-np", "4"])
    prompts = [token_prompt(192, 6), token_prompt(192, 7)]
    # the family arrives when the two prompts hold about 200 cells each (408 at their end): the
    # pool then overflows while the family runs, one prompt is parked, and the other (the
    # leader) must make room
    a = grown_alone(srv, lambda: streamed(srv.url, body(prompts, 216)), 192, 200,
                    what="both prompts", n_slots=2)
    b = streamed(srv.url, body(token_prompt(8, 8), 150, n_cmpl=2))
    res = a.result()
    assert res.status == 200
    check_notices(Notices(True), res)  # type: ignore[arg-type]
    check_notices(Notices(True), b)  # type: ignore[arg-type]  # a family: named notices
    # both fit alone, so both complete
    assert_complete(res, 2, [192, 192], 216, multi_prompt=True)
    assert_complete(b, 2, [8], 150, multi_prompt=False, family=True)
    wait_settled(srv.url)


# two n_cmpl families -----------------------------------------------------------------------------


def test_two_families_that_overflow_together_both_finish(start_server: StartServer) -> None:
    """Two n_cmpl 2 families that each fit the pool alone (8 shared + 2 x 200 cells) but not
    together. Family members share their prompt's cells, so one is never parked alone; with
    nothing else to park, both families used to get the context error. A whole family is
    parked instead, and both end with the answers they get alone. The families are the two
    prompts of one request, so they start in the same iteration on a machine of any speed (as
    two requests, a busy machine could finish the first before the second arrived)."""
    srv = start_server(args=[*BASE, *PARK, "-c", "512", "-np", "4"])
    prompts = [token_prompt(8, 60 + i) for i in range(2)]
    solo = [parse_stream(streamed(srv.url, body(p, 200, n_cmpl=2)))[2] for p in prompts]
    res = streamed(srv.url, body(prompts, 200, n_cmpl=2))
    # results are numbered family by family: the first family's two, then the second's
    finals = assert_complete(res, 4, [8], 200, multi_prompt=False, family=True)
    tokens = parse_stream(res)[2]
    for i, alone in enumerate(solo):
        assert {j: tokens[2 * i + j] for j in range(2)} == alone, i
    parks = sum(f["preempt"]["parks"] for f in finals.values())
    assert parks >= 2, "no family was parked"  # a family is parked whole: both of its members
    m = wait_settled(srv.url)
    assert m["n_resume_total"] == m["n_preempt_total"]


# admission behind the parked line ------------------------------------------------------------


def test_admission_waits_behind_a_parked_head(start_server: StartServer, slow_model: Path) -> None:
    """A new request that arrives while a slot is parked waits until the parked slot is back,
    although a slot is free and the pool has room for it: admitted first, a stream of small
    requests would take the room the parked head waits for and keep it parked indefinitely."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "256", "-np", "3"])
    pair = park_a_pair(srv)
    newcomer = stream_sse(f"{srv.url}/completion",
                          completion_body(token_prompt(8, 52), 8, stream=True))
    parked = next(log for log in pair.result()
                  if any(line.startswith(": resumed") for _, line in log.lines))
    assert parked.status == 200
    assert newcomer.status == 200
    assert len(newcomer.tokens()) == 8

    def absolute(log: StreamLog, pick: Any) -> float:
        return log.t_start + next(t for t, line in log.lines if pick(line))

    t_resumed = absolute(parked, lambda line: line.startswith(": resumed"))
    t_first = absolute(newcomer, lambda line: line.startswith("data: "))
    assert t_first > t_resumed, (
        f"the newcomer's first token came {t_resumed - t_first:.2f} s before the parked prompt "
        "was restored")
    wait_settled(srv.url)


# --preempt-ram values ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0.05", "1.5", "abc", "8M", "-2", ""])
def test_preempt_ram_rejects_what_it_cannot_take(start_server: StartServer, value: str) -> None:
    with pytest.raises(ServerDied) as e:
        start_server(args=[*BASE, "-c", "256", "-np", "2", "--preempt-ram", value], timeout=60)
    assert "--preempt-ram" in str(e.value), str(e.value)[-2000:]
    assert value in str(e.value), str(e.value)[-2000:]


@pytest.mark.parametrize("value", ["0", "1.5", "abc", "-1", "3601", ""])
def test_preempt_keepalive_rejects_what_it_cannot_take(
    start_server: StartServer, value: str
) -> None:
    with pytest.raises(ServerDied) as e:
        start_server(args=[*BASE, "-c", "256", "-np", "2", "--preempt-ram", "64",
                           "--preempt-keepalive", value], timeout=60)
    message = str(e.value)
    assert "--preempt-keepalive takes a whole number of seconds" in message, message[-2000:]


def test_preempt_ram_env_rejects_a_fraction(start_server: StartServer) -> None:
    with pytest.raises(ServerDied) as e:
        start_server(args=[*BASE, "-c", "256", "-np", "2"],
                     env={"LLAMA_ARG_PREEMPT_RAM": "0.05"}, timeout=60)
    assert "--preempt-ram" in str(e.value), str(e.value)[-2000:]
    assert "0.05" in str(e.value), str(e.value)[-2000:]


@pytest.mark.parametrize(("args", "echo"), [
    (["--preempt-ram", "64"], "KV preemption: on, --preempt-ram 64 "),
    (["--preempt-ram", "-1"], "KV preemption: on, --preempt-ram -1 "),
    (["--preempt-ram", "0"], "KV preemption: off (--preempt-ram 0)"),
    ([], "KV preemption: off (--preempt-ram 0)"),
])
def test_the_effective_setting_is_echoed(start_server: StartServer, args: list[str],
                                        echo: str) -> None:
    srv = start_server(args=[*BASE, "-c", "256", "-np", "2", *args])
    # the server's log thread may write its startup lines after /health answers
    wait_for(lambda: echo in srv.log_text(), timeout=10, what=f"{echo!r} in the log")


# one slot ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_one_slot_still_carries_a_preempt_record(start_server: StartServer, stream: bool) -> None:
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "1"])
    off = "KV preemption is off: it needs at least 2 slots"
    wait_for(lambda: off in srv.log_text(), timeout=10, what=f"{off!r} in the log")
    if stream:
        res = streamed(srv.url, body(token_prompt(8, 9), 16))
        finals = assert_complete(res, 1, [8], 16, multi_prompt=False)
        final = finals[0]
    else:
        final = httpx.post(f"{srv.url}/completion", json=body(token_prompt(8, 9), 16, stream=False),
                           timeout=60).json()
    assert final["preempt"] == {"parks": 0, "recomputes": 0}


# a family's shared prompt --------------------------------------------------------------------


def test_family_cells_are_counted_once(start_server: StartServer, slow_model: Path) -> None:
    """An n_cmpl 2 family with a 150-token prompt shares the prompt's cells: it holds 150 + 2 x 80
    cells at most, not 2 x (150 + 80). R (60 + 98 cells) runs beside it: everything fits the
    512-cell pool (about 470 cells), so nothing may be parked. Counting the prompt once per
    member (460 cells for the family alone at the end) parked R, the smaller slot, about 40
    tokens after the family came (R holds 80-135 cells then)."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "512", "-np", "3"])
    r = grown_alone(srv, lambda: streamed(srv.url, body(token_prompt(60, 11), 98)), 60, 80,
                    what="R")
    f = streamed(srv.url, body(token_prompt(150, 10), 80, n_cmpl=2))
    r_res = r.result(300)
    assert_complete(f, 2, [150], 80, multi_prompt=False, family=True)
    finals = assert_complete(r_res, 1, [60], 98, multi_prompt=False)
    assert finals[0]["preempt"]["parks"] == 0
    m = wait_settled(srv.url)
    assert m["n_preempt_total"] == 0, m


# a restore and the draft ---------------------------------------------------------------------


def test_restore_admission_counts_the_draft(start_server: StartServer, tiny_model: Path) -> None:
    """With --spec-draft-n-max 16 a restore must leave room for the sampled token and its draft:
    otherwise it is admitted, the decode does not fit, and the last resort parks again."""
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "2", "-md", str(tiny_model),
                             "--spec-type", "draft-simple", "--spec-draft-n-max", "16"])
    prompts = [token_prompt(8, 12), token_prompt(8, 13)]
    res = streamed(srv.url, body(prompts, 160))
    assert_complete(res, 2, [8, 8], 160, multi_prompt=True)
    m = wait_settled(srv.url)
    assert m["n_preempt_total"] >= 1
    assert count_lines(srv.log_text(), LAST_RESORT_LINE) == 0
    assert metrics(srv.url)["n_resume_total"] == m["n_preempt_total"]


# a multi-prompt non-streamed OAI response ----------------------------------------------------


def test_merged_oai_response_sums_the_preempt_records(start_server: StartServer) -> None:
    """/v1/completions with two prompts, not streamed, answers one object whose choices are the
    prompts: its `preempt` record must count the parks of both (it kept the first prompt's)."""
    srv = start_server(args=[*BASE, *PARK, "-c", "512", "-np", "2"],
                       env={"LLAMA_SERVER_PREEMPT_EVERY": "8"})

    def oai(prompt: list[int] | list[list[int]]) -> dict[str, Any]:
        r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True,
            "logit_bias": {str(t): -100 for t, _ in BAN_BYTE_TOKENS}})
        assert r.status_code == 200, r.text[:400]
        return dict(r.json())

    one = oai(token_prompt(8, 14))["preempt"]
    assert one["parks"] >= 6, one
    both = oai([token_prompt(8, 14), token_prompt(8, 15)])
    assert len(both["choices"]) == 2
    # forced parks come every 8 generated tokens of each prompt: the same count for both
    assert both["preempt"] == {"parks": 2 * one["parks"], "recomputes": 0}, both["preempt"]


# found by the multimodal tests: two prompts finishing in the same batch -------------------------


def test_last_resort_parks_a_slot_whose_prompt_ended_in_the_failing_batch(
    start_server: StartServer,
) -> None:
    """Planner off, 64-token batches: two 130-token prompts finish in the same batch, which does
    not fit the pool. Both slots were in DONE_PROMPT there, which the victim choice did not count
    as running, so the last resort found no victim and both requests, each of which fits alone,
    got "Context size has been exceeded." One must be parked and both end with their solo
    answers."""
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "2", "-b", "64", "-ub", "64"],
                       env={"LLAMA_SERVER_PREEMPT_PLANNER": "off"})
    prompts = [token_prompt(130, 60), token_prompt(130, 61)]
    solo, together = solo_then_together(srv.url, prompts, 40)
    for got, ref in zip(together, solo, strict=True):
        assert got.error is None, got.error
        assert_same(got, ref, 40)
    assert LAST_RESORT_LINE in srv.log_text()
    wait_settled(srv.url)

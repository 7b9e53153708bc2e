"""Park notices on streams (the stream-notices patch; docs/preemption.md, "Stream notices").

Streams are read raw with `tests.support.llama.stream_sse`, which keeps comment lines (SSE
clients hide them) and timestamps every line. The data of a stream must be the same with and
without parks; the comments say when the slot was parked and restored.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BASE,
    PARK,
    ROTATE_NOW,
    RawStream,
    completion_body,
    metrics,
    n_decoded_max,
    robust_prompts,
    slots,
    token_prompt,
    wait_for,
    wait_settled,
)
from tests.support.sse_client import StreamLog, stream_sse

pytestmark = [pytest.mark.server]

NOTICE_RE = re.compile(r"^: (preempted|resumed|recomputed)(?: (\d+))?$")


def notices(log: StreamLog) -> list[tuple[str, int | None]]:
    out = []
    for _, line in log.comments:
        m = NOTICE_RE.match(line)
        if m:
            out.append((m.group(1), int(m.group(2)) if m.group(2) is not None else None))
    return out


def assert_paired(log: StreamLog) -> int:
    """Per prompt, notices alternate preempted / resumed (a ": recomputed" may follow a resume),
    starting with a park and ending resumed. Returns the number of pairs."""
    state: dict[int | None, str] = {}
    pairs = 0
    for kind, index in notices(log):
        last = state.get(index, "resumed")
        if kind == "preempted":
            assert last in ("resumed", "recomputed"), f"park after {last} for prompt {index}"
        elif kind == "resumed":
            assert last == "preempted", f"resume after {last} for prompt {index}"
            pairs += 1
        else:
            assert last == "resumed", f"recomputed after {last} for prompt {index}"
        state[index] = kind
    assert all(k != "preempted" for k in state.values()), f"a stream ended parked: {state}"
    return pairs


def data_payloads(
    log: StreamLog, drop: tuple[str, ...] = ("timings", "preempt", "id_slot")
) -> list[Any]:
    """The data events without the fields that legitimately differ between runs."""
    out = []
    for ev in log.events:
        if isinstance(ev, dict):
            ev = {k: v for k, v in ev.items() if k not in drop}
        out.append(ev)
    return out


def completion(url: str, prompt: list[int], n: int, **extra: Any) -> StreamLog:
    return stream_sse(f"{url}/completion", completion_body(prompt, n, stream=True, **extra))


# 1 ---------------------------------------------------------------------------------------------


def test_forced_parks_are_announced_and_change_no_data(start_server: StartServer) -> None:
    args = [*BASE, *PARK, "-c", "512", "-np", "2"]
    plain = start_server(args=args)
    forced = start_server(args=args, env={"LLAMA_SERVER_PREEMPT_EVERY": "8"})
    prompt = robust_prompts(plain.url, 1, 8, 64)[0]

    ref = completion(plain.url, prompt, 64)
    got = completion(forced.url, prompt, 64)
    assert ref.status == got.status == 200
    assert not notices(ref)
    assert assert_paired(got) >= 6
    assert all(index is None for _, index in notices(got))  # one prompt: the bare form
    assert data_payloads(got) == data_payloads(ref)
    assert got.tokens() == ref.tokens()
    assert len(got.tokens()) == 64

    chat = {
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 64,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "stream": True,
        "logit_bias": completion_body([], 1)["logit_bias"],
    }
    ref_chat = stream_sse(f"{plain.url}/v1/chat/completions", chat)
    got_chat = stream_sse(f"{forced.url}/v1/chat/completions", chat)
    assert ref_chat.status == got_chat.status == 200
    assert assert_paired(got_chat) >= 6
    assert got_chat.content() == ref_chat.content()
    assert got_chat.content()
    assert got_chat.done
    assert got_chat.lines[-1][1] == "data: [DONE]"


# 2 ---------------------------------------------------------------------------------------------


def test_non_streaming_requests_see_no_comment(start_server: StartServer) -> None:
    args = [*BASE, *PARK, "-c", "512", "-np", "2"]
    plain = start_server(args=args)
    forced = start_server(args=args, env={"LLAMA_SERVER_PREEMPT_EVERY": "8"})
    prompt = robust_prompts(plain.url, 1, 8, 64)[0]
    body = completion_body(prompt, 64, stream=False)
    ref = httpx.post(f"{plain.url}/completion", json=body, timeout=60)
    got = httpx.post(f"{forced.url}/completion", json=body, timeout=60)
    assert got.status_code == 200
    assert not got.text.startswith(":")
    assert "\n:" not in got.text
    g, r = got.json(), ref.json()
    assert g["preempt"]["parks"] >= 6
    assert (g["content"], g["tokens"]) == (r["content"], r["tokens"])


# 3, 4, 6 ----------------------------------------------------------------------------------------

# A resident that generates without end: priority 1 ranks it above the stream that joins, so it is
# never the planner's victim nor rotated out, and with context shift it never ends. A shift leaves
# it 129 of the 256 cells, so a stream parked with more than 119 cells (or waiting to prefill as
# many) stays parked for as long as the test lets the resident run, on a model of any speed.
BEHIND_ENDLESS = [*BASE, *PARK, "-c", "256", "-np", "2", "--context-shift"]


@dataclass
class Behind:
    a: RawStream  # the resident, cut by the test
    b: StreamLog
    t_cut: float  # when A was cut, on B's clock


def park_behind_endless_resident(
    url: str, b_prompt: list[int], b_tokens: int, a_at: int, cut: Callable[[bytes], bool]
) -> Behind:
    """Resident A generates; when it holds `a_at` tokens, stream B starts and must wait for cells.
    A is cut when `cut(B's body so far)` holds (or after a minute, so that a missing notice fails
    the test rather than hanging it); then B is restored and finishes."""
    a = RawStream(url, token_prompt(8, 0), -1, priority=1)
    release = threading.Event()
    seen = bytearray()

    def on_read(_: float, data: bytes) -> None:
        seen.extend(data)
        if cut(bytes(seen)):
            release.set()

    logs: list[StreamLog] = []
    try:
        wait_for(lambda: n_decoded_max(url) >= a_at, timeout=120, what=f"A at {a_at} tokens")
        body = completion_body(b_prompt, b_tokens, stream=True)

        def run_b() -> None:
            logs.append(stream_sse(f"{url}/completion", body, on_read=on_read))
            release.set()

        tb = threading.Thread(target=run_b, daemon=True)
        tb.start()
        release.wait(60)
        t_cut = time.monotonic()
    finally:
        a.cancel()
    tb.join(300)
    assert logs, "B's stream never ended"
    return Behind(a, logs[0], t_cut - logs[0].t_start)


def keepalives(n: int) -> Callable[[bytes], bool]:
    return lambda body: body.count(b": preempt-keepalive") >= n


@pytest.mark.slow
def test_parked_stream_says_so_with_keepalives(start_server: StartServer, slow_model: Path) -> None:
    """Two streams that overflow the pool: the parked one is told (paired notices), and while it
    waits (two keepalives, about four seconds) it gets a keepalive at least every 2 s (interval
    + 1 s of reader slack). The slow model: B's long prompt joins A early enough to fit, and B is
    parked a few tokens into its generation, with about 200 cells."""
    srv = start_server(model=slow_model, args=BEHIND_ENDLESS)
    b_tokens = 40
    run = park_behind_endless_resident(
        srv.url, token_prompt(180, 1), b_tokens, a_at=2, cut=keepalives(2)
    )
    a, b = run.a, run.b
    assert a.data.startswith(b"HTTP/1.1 200"), a.data[:80]
    assert b.status == 200
    assert b": preempted" not in a.data, "the leader is never parked"
    assert assert_paired(b) >= 1
    assert b.lines[0][1].startswith("data: "), "B was parked before its first token"
    assert len(b.tokens()) == b_tokens
    assert b.done is False
    gaps = keepalive_gaps(b)
    assert gaps, "a park of several seconds carried no keepalive"
    assert max(gaps) <= 2 + 1, gaps
    assert wait_settled(srv.url)["requests_preempted"] == 0


def keepalive_gaps(log: StreamLog) -> list[float]:
    """Silences while parked: from a park notice through its keepalives to the resume."""
    gaps: list[float] = []
    t_last: float | None = None
    for t, line in log.lines:
        if line == ": preempted":
            t_last = t
        elif t_last is not None and line in (": preempt-keepalive", ": resumed"):
            if line == ": preempt-keepalive" or gaps:
                gaps.append(t - t_last)
            t_last = None if line == ": resumed" else t
    return gaps


@pytest.mark.slow
@pytest.mark.parametrize(
    "interval_args",
    [["--sse-ping-interval", "1"], ["--sse-ping-interval", "-1", "--preempt-keepalive", "1"]],
    ids=["shorter-ping-interval", "preempt-keepalive"],
)
def test_keepalive_spacing_follows_the_shorter_interval(
    start_server: StartServer, interval_args: list[str]
) -> None:
    """Keepalives while parked come every min(--sse-ping-interval, --preempt-keepalive) seconds:
    a 1 s ping interval, or (pings disabled) --preempt-keepalive 1, spaces them by 1 s, not by
    the default 2 s. B waits to prefill a prompt that does not fit beside A, for four
    keepalives."""
    srv = start_server(args=[*BEHIND_ENDLESS, *interval_args])
    b = park_behind_endless_resident(
        srv.url, token_prompt(150, 1), 8, a_at=120, cut=keepalives(4)
    ).b
    assert assert_paired(b) >= 1
    kept = [t for t, line in b.lines if line == ": preempt-keepalive"]
    assert len(kept) >= 2, f"{len(kept)} keepalives; comments: {b.comments}"
    spacing = [y - x for x, y in itertools.pairwise(kept)]
    assert max(spacing) <= 1 + 1, spacing
    assert sorted(spacing)[len(spacing) // 2] < 1.5, f"spacing is 2 s, not 1: {spacing}"


def test_park_during_prompt_opens_the_stream(start_server: StartServer) -> None:
    """B's prompt does not fit beside A: B is parked before its first token, and its stream opens
    with ": preempted" at once, while A is still running; then ": resumed", then data."""
    srv = start_server(args=BEHIND_ENDLESS)
    run = park_behind_endless_resident(
        srv.url, token_prompt(150, 2), 8, a_at=120, cut=lambda body: b": preempted" in body
    )
    b = run.b
    assert b.status == 200
    first_t, first = b.lines[0]
    assert first == ": preempted", b.lines[:3]
    assert first_t < run.t_cut, "B heard of its park only after A ended"
    kinds = [line for _, line in b.lines if not line.startswith(": preempt-keepalive")]
    assert kinds[1] == ": resumed"
    assert kinds[2].startswith("data: ")
    assert b.final()["timings"]["prompt_n"] == 150
    assert_paired(b)


# 5 ---------------------------------------------------------------------------------------------


def test_last_resort_parks_are_announced(start_server: StartServer) -> None:
    srv = start_server(
        args=[*BASE, *PARK, "-c", "256", "-np", "2"],
        env={"LLAMA_SERVER_PREEMPT_PLANNER": "off"},
    )
    body = completion_body([token_prompt(8, 0), token_prompt(8, 1)], 160, stream=True)
    log = stream_sse(f"{srv.url}/completion", body)
    assert log.status == 200
    assert "preempted as a last resort" in srv.log_text()
    assert assert_paired(log) >= 1
    assert metrics(srv.url)["n_preempt_total"] == len(
        [n for n in notices(log) if n[0] == "preempted"]
    )


@pytest.mark.slow
def test_rotation_parks_are_announced(start_server: StartServer) -> None:
    # no wait before a rotation (ROTATE_NOW): the first shift after a park rotates, at any speed
    srv = start_server(
        args=[*BASE, *PARK, "-c", "256", "-np", "3", "--context-shift"], env=ROTATE_NOW
    )
    prompts = [token_prompt(8, i) for i in range(3)]
    log = stream_sse(f"{srv.url}/completion", completion_body(prompts, 300, stream=True))
    assert log.status == 200
    assert "rotated out after" in srv.log_text()
    assert assert_paired(log) >= 1
    assert len([e for e in log.events if isinstance(e, dict) and e.get("stop")]) == 3


# 7 ---------------------------------------------------------------------------------------------


def test_multi_prompt_notices_name_the_prompt(start_server: StartServer) -> None:
    srv = start_server(
        args=[*BASE, *PARK, "-c", "512", "-np", "2"], env={"LLAMA_SERVER_PREEMPT_EVERY": "8"}
    )
    body = completion_body([token_prompt(8, 0), token_prompt(8, 1)], 48, stream=True)
    log = stream_sse(f"{srv.url}/completion", body)
    assert log.status == 200
    found = notices(log)
    assert found, found
    assert all(index in (0, 1) for _, index in found), found
    assert {index for _, index in found} == {0, 1}
    for _, line in log.comments:
        if line.startswith(": preempted") or line.startswith(": resumed"):
            assert re.fullmatch(r": (preempted|resumed) [01]", line), line
    assert_paired(log)


# 8 ---------------------------------------------------------------------------------------------


def assert_plain_error(r: httpx.Response) -> None:
    assert r.status_code != 200
    assert not r.text.startswith(":")
    assert "error" in r.json()


def test_oversized_prompts_keep_their_4xx(start_server: StartServer) -> None:
    """Prompts that cannot fit are answered with a plain 4xx while a resident generates, and are
    never parked. The resident generates without end (context shift, no n_predict limit) until the
    test cancels it, so the checks run beside it however fast the model is."""
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "2", "--context-shift"])
    resident = RawStream(srv.url, token_prompt(8, 0), -1)
    try:
        wait_for(
            lambda: any(s["is_processing"] for s in slots(srv.url)), what="a resident", timeout=60
        )
        # an oversized prompt behind a resident is rejected, never parked
        big = completion_body(token_prompt(300, 3), 8, stream=True)
        assert_plain_error(httpx.post(f"{srv.url}/completion", json=big, timeout=120))
        # an oversized sibling: the whole request is rejected before any prompt is queued
        multi = completion_body([token_prompt(8, 4), token_prompt(300, 5)], 8, stream=True)
        assert_plain_error(httpx.post(f"{srv.url}/completion", json=multi, timeout=120))
        assert not resident.closed_by_server, "the resident ended before the checks ran"
        assert resident.n_data_events() > 0
    finally:
        resident.cancel()
    wait_settled(srv.url)
    assert metrics(srv.url)["n_preempt_total"] == 0


# 9 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fail_save", [False, True])
def test_recompute_restores_say_so(start_server: StartServer, fail_save: bool) -> None:
    env = {"LLAMA_SERVER_PREEMPT_EVERY": "8"}
    if fail_save:
        env["LLAMA_SERVER_PREEMPT_FAIL_SAVE"] = "1"
    srv = start_server(args=[*BASE, *PARK, "-c", "512", "-np", "2"], env=env)
    log = completion(srv.url, token_prompt(8, 0), 48)
    lines = [line for _, line in log.comments]
    resumes = [i for i, line in enumerate(lines) if line == ": resumed"]
    assert len(resumes) >= 4
    if fail_save:
        assert all(lines[i + 1] == ": recomputed" for i in resumes), lines
        assert log.final()["preempt"]["recomputes"] == len(resumes)
    else:
        assert ": recomputed" not in lines
        assert log.final()["preempt"]["recomputes"] == 0
    assert_paired(log)

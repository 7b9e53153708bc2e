"""Request priority for KV preemption: who is parked and who comes back first.

The planner ranks requests by their `priority` (default 0, higher is more important): victims go
lowest first, restores highest first, and a request parked `--preempt-aging` seconds in total
ranks above every priority so that a low priority waits longer but never forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BASE,
    PARK,
    Completion,
    complete,
    complete_many,
    metrics,
    n_decoded_max,
    robust_prompts,
    robust_solo_runs,
    slots,
    token_prompt,
    wait_for,
    wait_settled,
)
from tests.support.llama import LlamaServer

pytestmark = [pytest.mark.server]

HIGH, LOW = 5, -1


@pytest.fixture(scope="module")
def validating_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """One server for the request validation cases: a rejected request leaves nothing behind."""
    log = tmp_path_factory.mktemp("priority") / "llama-server.log"
    srv = LlamaServer(llama_server_bin, tiny_model, [*BASE, *PARK, "-c", "256", "-np", "2"],
                      log_path=log)  # fmt: skip
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("/completion", "high"),
        ("/completion", 1.5),
        ("/v1/completions", "1"),
        ("/v1/chat/completions", 2.5),
        ("/completion", 10**9),
    ],
)
def test_priority_must_be_an_integer(
    validating_server: LlamaServer, path: str, value: object
) -> None:
    srv = validating_server
    body: dict[str, object] = {"n_predict": 2, "priority": value}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hello"
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "priority" in r.text
    # and an integer is taken, on every completion route
    for route in ("/completion", "/v1/completions"):
        ok = httpx.post(srv.url + route, json={"prompt": "hello", "n_predict": 2, "priority": -3})
        assert ok.status_code == 200, ok.text
    assert srv.alive()


def test_only_low_priority_requests_are_parked(start_server: StartServer, slow_model: Path) -> None:
    """Two low-priority generations run; a high-priority one joins late, so it is the smallest
    slot when the pool fills: without priorities it would be the one parked. With them, only
    low-priority requests are parked, the high one never is, and every stream gets its solo
    tokens."""
    # 40 prompt and 60 generated cells each on 256: the pool fills at about 80 % of each
    # generation, most of each slot's size coming from its prompt (a fraction of a generated
    # token's cost)
    cells = 256
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", str(cells), "-np", "3"])
    n = 60
    low_runs = robust_solo_runs(srv.url, 2, 40, n)
    high_run = robust_solo_runs(srv.url, 1, 40, n, first_seed=50)[0]
    low_prompts = [p for p, _ in low_runs]
    high_prompt = high_run[0]
    solo = {tuple(p): tokens for p, tokens in [*low_runs, high_run]}

    results: dict[str, list[Completion]] = {}

    def lows() -> None:
        results["low"] = complete_many(srv.url, low_prompts, n, priority=LOW)

    t = threading.Thread(target=lows, daemon=True)
    t.start()
    wait_for(lambda: n_decoded_max(srv.url) >= 12, timeout=120, what="the low streams under way")
    high = complete(srv.url, high_prompt, n, priority=HIGH)
    t.join(300)

    assert high.ok, high.error
    assert high.preempt["parks"] == 0, "a high-priority request was parked while low ones ran"
    assert sum(c.preempt["parks"] for c in results["low"]) >= 1, "the pool never overflowed"
    for got, prompt in [(high, high_prompt), *zip(results["low"], low_prompts, strict=True)]:
        assert got.ok, got.error
        assert got.tokens == solo[tuple(prompt)]
        assert len(got.tokens) == n
    m = wait_settled(srv.url)
    assert m["n_preempt_priority_high_total"] == 0
    assert m["n_preempt_priority_low_total"] == m["n_preempt_total"] >= 1
    assert m["requests_preempted"] == 0
    assert m["n_resume_total"] == m["n_preempt_total"]
    assert any(s.get("priority") == HIGH for s in slots(srv.url)), slots(srv.url)
    # the KV gauges a load balancer reads (the sidecar's --ready-min-free-kv): all free again
    assert m["kv_cells_total"] == cells, m
    assert m["kv_cells_used"] == 0, m


def test_forced_parks_with_a_priority_change_nothing(start_server: StartServer) -> None:
    args = [*BASE, *PARK, "-c", "512", "-np", "2"]
    plain = start_server(args=args)
    forced = start_server(args=args, env={"LLAMA_SERVER_PREEMPT_EVERY": "8"})
    prompt = robust_prompts(plain.url, 1, 8, 64)[0]
    ref = complete(plain.url, prompt, 64)
    got = complete(forced.url, prompt, 64, priority=HIGH)
    assert ref.ok, (ref.error, got.error)
    assert got.ok, (ref.error, got.error)
    assert got.tokens == ref.tokens
    assert got.content == ref.content
    assert got.preempt["parks"] >= 6
    assert metrics(forced.url)["n_preempt_priority_high_total"] >= 6


def test_a_starving_low_priority_request_still_finishes(
    start_server: StartServer, slow_model: Path
) -> None:
    """High-priority requests keep the pool full without a pause; the low-priority one is parked
    for them, yet once it has waited --preempt-aging seconds it ranks first and completes while
    they are still coming."""
    args = [*BASE, *PARK, "-c", "256", "-np", "3", "--preempt-aging", "1"]
    srv = start_server(model=slow_model, args=args)
    # the server's log thread may write its startup lines after /health answers
    wait_for(lambda: "--preempt-aging 1.0" in srv.log_text(), timeout=10,
             what="the aging setting in the log")
    # long enough to be running when the pool fills (about 55 tokens in, beside two high
    # requests of 8 + 100 cells on 256), most of its size from its prompt
    n_low = 90
    low_prompt, solo_tokens = robust_solo_runs(srv.url, 1, 60, n_low, first_seed=80)[0]

    stop = threading.Event()
    highs: list[Completion] = []

    def high_load(seed: int) -> None:
        while not stop.is_set():
            # cut once the low request is done: the load's last requests prove nothing more
            highs.append(complete(srv.url, token_prompt(8, seed), 100, priority=HIGH,
                                  cancel_event=stop))
            seed += 2

    low: list[Completion] = []
    lt = threading.Thread(
        target=lambda: low.append(complete(srv.url, low_prompt, n_low, priority=LOW))
    )
    lt.start()
    wait_for(lambda: n_decoded_max(srv.url) >= 8, timeout=120, what="the low stream under way")
    loaders = [threading.Thread(target=high_load, args=(s,), daemon=True) for s in (1000, 1001)]
    for th in loaders:
        th.start()
    t0 = time.monotonic()
    lt.join(240)
    still_loaded = not stop.is_set() and all(th.is_alive() for th in loaders)
    stop.set()
    for th in loaders:
        th.join(300)

    assert low, "the low-priority request never finished"
    assert low[0].ok, low[0].error
    assert still_loaded, "the high-priority load ended before the low request finished"
    assert low[0].preempt["parks"] >= 1, "the high-priority load never parked the low request"
    assert low[0].tokens == solo_tokens
    done = [h for h in highs if not h.cancelled]
    assert done, "no high-priority request ran to its end"
    assert all(h.ok for h in done), [h.error for h in done if not h.ok]
    assert time.monotonic() - t0 < 240
    m = wait_settled(srv.url)
    assert m["requests_preempted"] == 0
    assert m["n_resume_total"] == m["n_preempt_total"]

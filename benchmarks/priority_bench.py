"""What request priority buys a high-priority request under overload.

    python -m benchmarks.priority_bench [--rounds N] [--json FILE]

One patched server, a pool that three long low-priority generations overflow. When they are
close to filling it, one short "interactive" request arrives. Two modes, interleaved round by
round on the same server:

* with priorities:    the lows carry priority -1, the interactive request priority 5;
* without priorities: everyone at the default 0 (what the server did before request priority).

Without priorities the interactive request is the smallest slot when the pool fills, so it is
the one parked until a long generation ends. With them a low-priority generation is parked
instead. Reported: the interactive request's time to first token and total time (median over
rounds) and how often it was parked, side by side, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks.preempt_bench import Servers
from sidecar.paths import cache_dir
from tests.server.preempt_helpers import (
    BASE,
    PARK,
    Completion,
    complete,
    complete_many,
    slots,
    token_prompt,
    wait_for,
    wait_settled,
)
from tests.support.tinymodel import ensure_model

REPO = Path(__file__).resolve().parent.parent

POOL, N_LOW, N_HIGH = 768, 300, 64
ARRIVE_AT = 225  # low tokens decoded when the interactive request arrives


def one_round(url: str, priorities: bool, seed: int) -> dict[str, Any]:
    low_prio, high_prio = (-1, 5) if priorities else (0, 0)
    lows: list[Completion] = []
    prompts = [token_prompt(8, seed + i) for i in range(3)]
    t = threading.Thread(
        target=lambda: lows.extend(complete_many(url, prompts, N_LOW, priority=low_prio)),
        daemon=True,
    )
    t.start()
    wait_for(
        lambda: any(s["next_token"][0]["n_decoded"] >= ARRIVE_AT for s in slots(url)
                    if s["is_processing"]),
        timeout=300, interval=0.01, what="the low generations near the pool limit",
    )  # fmt: skip
    high = complete(url, token_prompt(8, seed + 100), N_HIGH, priority=high_prio)
    t.join(600)
    wait_settled(url)
    assert high.ok and all(c.ok for c in lows), (high.error, [c.error for c in lows])
    return {
        "ttft": high.t_events[0] if high.t_events else high.t_end,
        "total": high.t_end,
        "high_parks": high.preempt["parks"],
        "low_parks": sum(c.preempt["parks"] for c in lows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    model = ensure_model(cache_dir() / "models", "slow")
    with tempfile.TemporaryDirectory() as tmp:
        servers = Servers(Path(tmp))
        try:
            srv = servers.start(False, model, [*BASE, *PARK, "-c", str(POOL), "-np", "4"])
            runs: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
            for r in range(args.rounds):
                for mode in ("without", "with"):
                    res = one_round(srv.url, mode == "with", seed=10 * r)
                    runs[mode].append(res)
                    print(f"round {r} {mode:8} {res}", flush=True)
        finally:
            servers.stop_all()

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[mode])

    print(f"\ninteractive request ({N_HIGH} tokens) arriving as three {N_LOW}-token generations"
          f" near-fill a {POOL}-cell pool; median of {args.rounds} rounds")  # fmt: skip
    print("| priorities | time to first token | total time | parked (rounds) | lows parked |")
    print("|---|---|---|---|---|")
    for mode in ("without", "with"):
        parked = sum(1 for x in runs[mode] if x["high_parks"] > 0)
        lows = sum(x["low_parks"] for x in runs[mode])
        print(f"| {mode} | {med(mode, 'ttft'):.2f} s | {med(mode, 'total'):.2f} s "
              f"| {parked}/{len(runs[mode])} | {lows} |")  # fmt: skip
    print(f"ratio without/with: first token {med('without', 'ttft') / med('with', 'ttft'):.2f}x, "
          f"total {med('without', 'total') / med('with', 'total'):.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()

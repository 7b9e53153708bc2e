"""The fixed-deadline wait, stock vs patched: pings a waiting stream gets on a busy server.

    python -m benchmarks.wait_pings [--rounds N]

The scenario of tests/server/test_fixed_deadline_wait.py (stream A generates while stream B
prefills 25,000 tokens in 64-token batches, --sse-ping-interval 1), run on the stock and the
patched build interleaved S P S P. Prints B's wait before its first token, the pings B got
meanwhile, and the tokens A produced meanwhile (each one a wakeup of B's wait).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from sidecar.cli.build import server_binary
from sidecar.paths import cache_dir
from tests.server.test_fixed_deadline_wait import (
    ARGS,
    busy_prefill,
    check_scenario,
    prefill_window,
)
from tests.support.llama import LlamaServer
from tests.support.tinymodel import ensure_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    rounds = ap.parse_args().rounds
    model = ensure_model(cache_dir() / "models", "tiny")
    print("build    wait_s  pings  pings/s  A_tokens_meanwhile")
    for _ in range(rounds):
        for name, stock in (("stock", True), ("patched", False)):
            with tempfile.TemporaryDirectory() as tmp:
                srv = LlamaServer(server_binary(stock), model, ARGS, {}, log_path=Path(tmp) / "log")
                srv.start()
                try:
                    b, a_times = busy_prefill(srv)
                    window, n = check_scenario(b, a_times)
                    start, end, _ = prefill_window(b)
                    busy = sum(1 for t in a_times if start < t - b.t_start < end)
                    print(f"{name:8s} {window:6.1f} {n:6d} {n / window:8.2f}  {busy}", flush=True)
                finally:
                    srv.stop()


if __name__ == "__main__":
    main()

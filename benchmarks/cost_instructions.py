"""What the preemption patch costs when nothing parks, in instructions rather than seconds.

    python -m benchmarks.cost_instructions [--short 64] [--long 576]

Wall-clock tokens/s on a shared 2-core machine swing by +-30 % between runs, which hides a
1 % overhead. Instruction counts do not: every llama-server process here runs under
`valgrind --tool=callgrind`, which counts the instructions it executes whatever else the
machine is doing. Each workload runs twice, with a short and a long generation, and the
difference divided by the extra tokens is the cost of one generated token, free of start-up
and model loading. Stock and patched (`--preempt-ram 8192`: the planner runs every step) are
measured on the same workloads: 1 stream, and 2 streams that fit (one request, two prompts,
so they share every batch).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from sidecar.cli.build import server_binary
from sidecar.paths import cache_dir
from tests.support.procs import free_port
from tests.support.tinymodel import ensure_model

ARGS = ["-t", "1", "-tb", "1", "-c", "4096", "-np", "2", "--kv-unified", "--no-warmup"]


def instructions(stock: bool, model: Path, streams: int, n_predict: int, tmp: Path) -> int:
    """Total instructions of one server process that serves one request and exits."""
    port = free_port()
    out = tmp / f"cg.{stock}.{streams}.{n_predict}"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", str(server_binary(stock)),
           "-m", str(model), "--port", str(port), *ARGS,
           *([] if stock else ["--preempt-ram", "8192"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("llama-server under valgrind did not start")
            time.sleep(0.2)
        prompts = [[1, 300 + i, 301, 302] for i in range(streams)]
        body = {"prompt": prompts if streams > 1 else prompts[0], "n_predict": n_predict,
                "ignore_eos": True, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=600)
        r.raise_for_status()
        results = r.json() if isinstance(r.json(), list) else [r.json()]
        assert all(x["timings"]["predicted_n"] == n_predict for x in results)
        if not stock:
            assert all(x["preempt"]["parks"] == 0 for x in results), "something parked"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    text = out.read_text(errors="replace")
    m = re.search(r"^totals:\s+(\d+)", text, re.M) or re.search(r"^summary:\s+(\d+)", text, re.M)
    assert m, f"no totals in {out}"
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--long", type=int, default=576)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    model = ensure_model(cache_dir() / "models", "tiny")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for streams in (1, 2):
            per_token = {}
            for stock in (True, False):
                short = instructions(stock, model, streams, a.short, Path(tmp))
                long = instructions(stock, model, streams, a.long, Path(tmp))
                per_token[stock] = (long - short) / ((a.long - a.short) * streams)
            ratio = per_token[False] / per_token[True]
            rows[f"{streams} stream(s)"] = {"stock": per_token[True], "patched": per_token[False],
                                            "patched_over_stock": ratio}
            print(f"{streams} stream(s): instructions per generated token: stock "
                  f"{per_token[True]:,.0f}, patched {per_token[False]:,.0f}, "
                  f"patched/stock {ratio:.4f} (tokens/s ratio ~ {1 / ratio:.4f})", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

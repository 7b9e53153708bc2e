"""What a parked stream hears: the probe of `llama-sidecar probe` against three servers.

    python -m benchmarks.keepalive_probe [--tokens N] [--stagger S] [--timeline] [--json FILE]

Two streaming /completion requests on the slow test model, sized so that they overflow the
pool together (2 x 420 tokens in 512 cells) and the second one is parked for seconds. The same
probe runs against:

* stock:            the unpatched build; the overflow fails both streams (no park at all);
* without notices:  the series before its notices patch (LLAMA_SERVER_NO_NOTICES_BIN, or built
                    from a series cut there): the stream is parked but silent for the whole park;
* patched:          the whole series; the parked stream hears `: preempted`, a
                    `: preempt-keepalive` at least every 2 s, then `: resumed`.

Every SSE line is printed with its arrival time and stream (--timeline); the summary gives
parks, resumes, keepalives and the longest silence per stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sidecar.cli.build import build_binary, server_binary
from sidecar.ops.probe import ProbeOptions, run_probe, summarize
from sidecar.paths import cache_dir
from tests.support.llama import LlamaServer
from tests.support.tinymodel import ensure_model

REPO = Path(__file__).resolve().parent.parent

ARGS = ["--kv-unified", "-np", "2", "-t", "1", "-tb", "1", "--no-warmup"]




NOTICES_PATCH = "tell-streaming-clients-about-parks"


def without_notices_binary() -> Path | None:
    """The series up to the notices patch: a copy of the repo's server_patch with `series` cut
    before the patch that tells streaming clients about parks (later patches build on it)."""
    override = os.environ.get("LLAMA_SERVER_NO_NOTICES_BIN")
    if override:
        return Path(override)
    series = (REPO / "server_patch" / "series").read_text().splitlines()
    cut = next((i for i, ln in enumerate(series) if NOTICES_PATCH in ln), None)
    if cut is None:
        return None
    kept = series[:cut]
    with tempfile.TemporaryDirectory(prefix="probe-series-") as tmp:
        root = Path(tmp)
        (root / "server_patch").mkdir()
        for f in (REPO / "server_patch").iterdir():
            if f.is_file():
                (root / "server_patch" / f.name).write_bytes(f.read_bytes())
        (root / "server_patch" / "series").write_text("\n".join(kept) + "\n")
        script = root / "build_llama.sh"
        script.write_bytes((REPO / "build_llama.sh").read_bytes())
        script.chmod(0o755)
        return build_binary(script=script, capture_stderr=True)


def probe(
    binary: Path, model: Path, label: str, ctx: int, opts: dict[str, Any], timeline: bool
) -> Any:
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        srv = LlamaServer(
            binary,
            model,
            [*ARGS, "-c", str(ctx), *(["--preempt-ram", "8192"] if label != "stock" else [])],
            {},
            log_path=Path(tmp) / "server.log",
        ).start()
        try:
            o = ProbeOptions(url=srv.url + "/completion", **opts)
            records = run_probe(o)
        finally:
            srv.stop()
    if timeline:
        lines = sorted(
            (rec.t_start + t, rec.index, line) for rec in records for t, line in rec.lines
        )
        for t, i, line in lines:
            print(f"{label:>16} {t:8.3f}s  stream {i}  {line[:100]}")
    return [summarize(r) for r in records]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ctx", type=int, default=512, help="the KV pool, in cells (default 512)")
    ap.add_argument("--tokens", type=int, default=420, help="tokens per stream (default 420)")
    ap.add_argument("--stagger", type=float, default=0.5)
    ap.add_argument("--timeline", action="store_true", help="print every line")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    model = ensure_model(cache_dir() / "models", "slow")
    opts = {
        "streams": 2,
        "max_tokens": a.tokens,
        "stagger": a.stagger,
        "extra": {"temperature": 0.0, "top_k": 1},
    }
    servers = [("stock", server_binary(stock=True))]
    no_notices = without_notices_binary()
    if no_notices is not None:
        servers.append(("without notices", no_notices))
    servers.append(("patched", server_binary()))

    results: dict[str, Any] = {}
    for label, binary in servers:
        summaries = probe(binary, model, label, a.ctx, opts, a.timeline)
        results[label] = [asdict(s) for s in summaries]
        for s in summaries:
            print(
                f"{label:>16}  stream {s.index}: {s.outcome:9} tokens {s.tokens:4}  "
                f"parks {s.parks} resumes {s.resumes} keepalives {s.keepalives:2}  "
                f"parked {s.parked_s:5.2f} s  longest silence {s.longest_silence_s:5.2f} s"
            )
    if a.json:
        for runs in results.values():
            for r in runs:
                for k in ("park_spans", "keepalive_times", "token_times"):
                    r.pop(k, None)
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

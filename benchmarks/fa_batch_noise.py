"""How far llama-server's greedy logprobs move with the batch shape, with and without flash
attention, with and without a park.

    python -m benchmarks.fa_batch_noise [--binary PATH] [--stock PATH]

Two image-first prompts for the generated Qwen2-VL pair (tests/support/tinymm.py), 40 tokens
each, 64-token batches: first each alone, then both in one request. For every generated token
the gap between the top two logprobs is compared with the solo run's; the largest difference
is printed per prompt. Runs: the stock server at -c 512 (the prompts fit together: no
preemption anywhere) and the patched server at -c 256 (the planner parks one prompt mid-prefill),
each with -fa on and -fa off. Where a solo gap is smaller than these differences, "the same
answer as alone" cannot be asked of any server, parked or not; the multimodal tests pick
prompts above them (FA_NOISE_GAP in tests/server/test_preempt_multimodal.py).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from sidecar.cli.build import server_binary
from sidecar.paths import cache_dir
from tests.server.preempt_helpers import (
    BASE,
    PARK,
    Completion,
    complete,
    complete_many,
    top2_gaps,
)
from tests.server.test_preempt_multimodal import robust_picture_prompts
from tests.support.llama import LlamaServer
from tests.support.tinymm import write_qwen2vl_mmproj, write_qwen2vl_text
from tests.support.tinymodel import cached

N_PREDICT = 40


def gaps(c: Completion) -> list[float]:
    assert c.final is not None, c.error
    return top2_gaps(c.final["completion_probabilities"])


def run(binary: Path, patched: bool, fa: str) -> str:
    models = cache_dir() / "models"
    text = cached(models / "llama-sidecar-qwen2vl-s77-d64x2.gguf", write_qwen2vl_text)
    proj = cached(models / "llama-sidecar-mmproj-qwen2vl_merger-s78-v32x2-to64.gguf",
                  write_qwen2vl_mmproj)
    args = [*BASE, *(PARK if patched else []), "--mmproj", str(proj),
            "-c", "256" if patched else "512", "-np", "2", "-b", "64", "-ub", "64", "-fa", fa]
    with tempfile.TemporaryDirectory() as tmp:
        srv = LlamaServer(binary=binary, model=text, args=args, log_path=Path(tmp) / "log").start()
        try:
            prompts = [
                *robust_picture_prompts(srv.url, 1, N_PREDICT, first_seed=20, n_words=24,
                                        image_first=True),
                *robust_picture_prompts(srv.url, 1, N_PREDICT, first_seed=30, n_words=14,
                                        image_first=True),
            ]
            solo = [complete(srv.url, p, N_PREDICT, stream=False, n_probs=2) for p in prompts]
            together = complete_many(srv.url, prompts, N_PREDICT, stream=False, n_probs=2)
        finally:
            srv.stop()
    parts = []
    for name, got, ref in zip("AB", together, solo, strict=True):
        # up to the first token that differs: until then both runs have the same context
        pairs = enumerate(zip(got.tokens, ref.tokens, strict=True))
        n = next((i + 1 for i, (a, b) in pairs if a != b), len(ref.tokens))
        diff = max(abs(a - b) for a, b in zip(gaps(got)[:n], gaps(ref)[:n], strict=True))
        same = "same tokens" if got.tokens == ref.tokens else f"token {n - 1} differs"
        parks = got.preempt.get("parks", 0)
        parts.append(f"{name}: max gap change {diff:.5f}, {same}, parks {parks}")
    return "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", type=Path, help="patched llama-server (default: build_llama.sh)")
    ap.add_argument("--stock", type=Path, help="stock llama-server (default: build_llama.sh)")
    a = ap.parse_args()
    stock = a.stock or server_binary(stock=True)
    patched = a.binary or server_binary(stock=False)
    for fa in ("on", "off"):
        print(f"stock   -c 512 -fa {fa:3}: {run(stock, False, fa)}")
        print(f"patched -c 256 -fa {fa:3}: {run(patched, True, fa)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

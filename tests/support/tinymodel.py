"""Deterministic random-weight llama models for tests and benchmarks.

Theory of operation: a llama-architecture GGUF is nothing but hyperparameters, a tokenizer
and tensors. The tests need a model that loads in llama-server, is tiny on disk, runs at
hundreds of tokens per second on one core, and gives the same tokens every time. So the
weights are drawn from a seeded generator, and the tokenizer is a small byte-level
SentencePiece vocabulary built here (three specials, the 256 byte tokens, the printable
ASCII characters with and without the word-start marker), so nothing outside this file is
needed. The output projection is drawn with a large spread so that the top logits are far
apart: greedy decoding is then stable across batch shapes, which is what makes "identical
to the solo run" a fair test.

`gguf` and `numpy` are test dependencies (`pip install -e '.[test]'`). From a checkout,
``python -m tests.support.tinymodel [tiny|slow]`` writes a model into the cache (if it is not
there yet) and prints its path, e.g. ``llama-sidecar up -m "$(python -m
tests.support.tinymodel)"``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.paths import models_dir

if TYPE_CHECKING:
    import numpy.typing as npt

SPACE = "\u2581"  # SentencePiece's word-start marker


@dataclass(frozen=True)
class TinySpec:
    """Shape of a generated model."""

    name: str
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    n_ctx_train: int = 65536
    seed: int = 1234


SPECS: dict[str, TinySpec] = {
    # ~1 MB, several hundred tokens/s on one core.
    "tiny": TinySpec("tiny", n_embd=64, n_layer=2, n_head=4, n_ff=128),
    # ~100 MB, tens of tokens/s: parks last seconds, not milliseconds.
    "slow": TinySpec("slow", n_embd=1024, n_layer=6, n_head=8, n_ff=2816, seed=4321),
}


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """A byte-level SentencePiece vocabulary: tokens, scores, token types."""
    normal, unknown, control, byte = 1, 2, 3, 6
    tokens = ["<unk>", "<s>", "</s>"]
    types = [unknown, control, control]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [byte] * 256
    printable = [chr(c) for c in range(33, 127)]
    pieces = [*printable, SPACE, *(SPACE + ch for ch in printable)]
    tokens += pieces
    types += [normal] * len(pieces)
    # Longer pieces win in SPM's merge order: score by length, ties broken by position.
    scores = [0.0] * (3 + 256) + [len(p) - i * 1e-4 for i, p in enumerate(pieces)]
    return tokens, scores, types


# the ids of the vocabulary's text pieces (after the three specials and the 256 byte tokens),
# 259-447: any sequence of them is a prompt
TEXT_TOKENS = range(3 + 256, len(_vocab()[0]))


def add_vocab(w: Any) -> None:
    """The shared test vocabulary and its llama tokenizer settings, on a ``gguf.GGUFWriter``."""
    tokens, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def write_model(path: str | os.PathLike[str], spec: TinySpec = SPECS["tiny"]) -> Path:
    """Write the model described by `spec` to `path` (atomically) and return the path."""
    import gguf
    import numpy as np

    path = Path(path)
    n_vocab, d, ff = len(_vocab()[0]), spec.n_embd, spec.n_ff
    head_dim = d // spec.n_head
    dtype = np.float32 if d <= 256 else np.float16
    normal = seeded_normal(spec.seed, dtype)
    w, tmp = open_writer(path, "llama")
    w.add_name(f"llama-sidecar {spec.name} random")
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(d)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(
        gguf.LlamaFileType.ALL_F32 if dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16
    )
    add_vocab(w)

    add_llama_tensors(w, normal, n_vocab, d, ff, spec.n_layer)
    return save_model(w, tmp, path)


def add_llama_tensors(w: Any, normal: Callable[[tuple[int, ...], float], Any], n_vocab: int,
                      d: int, ff: int, n_layer: int) -> None:
    """The tensors of a llama-style decoder (also Qwen2-VL's text model), drawn in a fixed
    order from `normal(shape, std)`: the same generator gives the same model."""
    import numpy as np

    ones = np.ones(d, dtype=np.float32)
    w.add_tensor("token_embd.weight", normal((n_vocab, d), 1.0))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", normal((d, d), d**-0.5))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", normal((ff, d), d**-0.5))
        w.add_tensor(f"blk.{i}.ffn_up.weight", normal((ff, d), d**-0.5))
        w.add_tensor(f"blk.{i}.ffn_down.weight", normal((d, ff), ff**-0.5))
    w.add_tensor("output_norm.weight", ones)
    # Spread logits far apart (std ~ sqrt(d)): greedy picks never sit on a near-tie.
    w.add_tensor("output.weight", normal((n_vocab, d), 1.0))


def seeded_normal(seed: int, dtype: Any = None) -> Callable[..., npt.NDArray[Any]]:
    """`normal(shape, std[, dtype])`: float32 draws from one generator seeded with `seed`, times
    `std`, cast to `dtype` (the call's, else this one's, else float32). The same seed and the same
    calls in the same order give the same tensors, which is what keeps every generated model
    byte-identical from run to run."""
    import numpy as np

    rng = np.random.default_rng(seed)
    default = np.float32 if dtype is None else dtype

    def normal(shape: tuple[int, ...], std: float, dtype: Any = None) -> npt.NDArray[Any]:
        draw = rng.standard_normal(shape, dtype=np.float32) * std
        return draw.astype(default if dtype is None else dtype)

    return normal


def open_writer(path: Path, arch: str) -> tuple[Any, Path]:
    """A ``gguf.GGUFWriter`` for `arch` on a temporary file beside `path` (its folder made):
    save_model(w, tmp, path) writes it and moves it into place."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    return gguf.GGUFWriter(str(tmp), arch), tmp


def save_model(w: Any, tmp: Path, path: Path) -> Path:
    """Write a filled GGUFWriter (open on `tmp`) and move the file to `path`: a run that dies
    half-way leaves no truncated model at `path` for the next run to load."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def ensure_model(cache_dir: str | os.PathLike[str], size: str = "tiny") -> Path:
    """Return the cached model of this size, writing it first if needed."""
    spec = SPECS[size]
    path = (
        Path(cache_dir)
        / f"llama-sidecar-{spec.name}-s{spec.seed}-d{spec.n_embd}x{spec.n_layer}.gguf"
    )
    return cached(path, lambda p: write_model(p, spec))


def cached(path: Path, write: Callable[[Path], object]) -> Path:
    """The generated model at ``path``, written by ``write(path)`` first if it is missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m tests.support.tinymodel",
        description="Write a generated test model (if missing) and print its path.",
    )
    ap.add_argument("size", nargs="?", default="tiny", choices=sorted(SPECS))
    ap.add_argument("--dir", type=Path, default=None, help="cache directory (default: the "
                    "llama-sidecar model cache)")  # fmt: skip
    a = ap.parse_args(argv)
    print(ensure_model(a.dir or models_dir(), a.size))


if __name__ == "__main__":
    main()

"""Random-weight LoRA adapters for the generated tiny llama model (tests/support/tinymodel.py).

A llama.cpp LoRA adapter is a GGUF of ``general.type = adapter`` holding, for each base matrix
W it changes (d_out x d_in), a pair ``<name>.lora_a`` (r x d_in) and ``<name>.lora_b``
(d_out x r); the layer then computes ``W x + (alpha / r) * B A x``. An *activated* LoRA
(aLoRA) also names its invocation tokens (``adapter.alora.invocation_tokens``): llama-server
runs the prompt before the first occurrence of that sequence without the adapter and
everything from it on with the adapter, so the cells before it are the base model's.

The adapters here change the attention projections of every layer strongly enough that a
greedy continuation of the tiny model differs with and without them; the tests check that
before they rely on it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tests.support.tinymodel import SPECS, TinySpec, open_writer, save_model, seeded_normal

TARGETS = ("attn_q", "attn_k", "attn_v")


def write_lora(
    path: str | os.PathLike[str],
    spec: TinySpec = SPECS["tiny"],
    *,
    rank: int = 8,
    alpha: float = 16.0,
    invocation_tokens: Sequence[int] = (),
    seed: int = 99,
) -> Path:
    """Write an adapter for the model of `spec` to `path`: a plain LoRA, or an aLoRA when
    `invocation_tokens` is given. Atomic like the model writers; returns the path."""
    import gguf

    path = Path(path)
    normal = seeded_normal(seed)
    d = spec.n_embd

    w, tmp = open_writer(path, "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    if invocation_tokens:
        w.add_key_value(
            gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS,
            [int(t) for t in invocation_tokens],
            gguf.GGUFValueType.ARRAY,
            sub_type=gguf.GGUFValueType.UINT32,
        )
    for i in range(spec.n_layer):
        for name in TARGETS:
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a", normal((rank, d), d**-0.5))
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b", normal((d, rank), rank**-0.5))
    return save_model(w, tmp, path)

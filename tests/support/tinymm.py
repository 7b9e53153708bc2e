"""A random-weight multimodal projector (mmproj GGUF) and tiny PNG images, for tests.

Theory of operation: llama-server loads a vision model as two files, the text model (`-m`) and
a "multimodal projector" (`--mmproj`): a CLIP-style vision encoder whose output rows are mapped
by a small MLP into the text model's embedding space. An image in a prompt becomes one chunk of
such rows, decoded into the KV cache like that many tokens. No real projector can be fetched
here, so this module writes the smallest one llama.cpp's `clip.cpp` loads: projector type
"mlp" (LLaVA-1.5), a ViT of a few layers over 8x8 patches, and a two-layer MLP whose output
size is the text model's `n_embd`. Weights are drawn from a seeded generator, so the image
rows (and therefore the tokens generated after them) are the same on every run.

The GGUF keys and tensor names are those `clip.cpp` reads (`clip-impl.h`: `KEY_*` and `TN_*`):

* keys: ``clip.has_vision_encoder``, ``clip.projector_type`` = "mlp", ``clip.vision.*``
  (embedding_length, feed_forward_length, block_count, projection_dim, attention.head_count,
  attention.layer_norm_epsilon, image_size, patch_size, image_mean, image_std);
* tensors: ``v.patch_embd.weight`` (the patch convolution), ``v.position_embd.weight``, per
  block ``v.blk.N.{ln1,attn_q,attn_k,attn_v,attn_out,ln2,ffn_up,ffn_down}.{weight,bias}``, and
  the projector ``mm.0.{weight,bias}`` and ``mm.2.{weight,bias}`` (the LLaVA MLP; ``mm.2`` is
  required: its rows are the output size llama.cpp checks against the text model).

The LLaVA graph runs blocks 0 .. n_layer-2 (it takes the second-to-last block's output), so a
two-block encoder runs one block. An image is resized to ``image_size`` square and becomes
``(image_size / patch_size) ** 2`` positions in the text model's KV cache: 16 for the default.

Images: `png(width, height, seed)` writes an RGB PNG by hand (zlib + struct), so no image
library is needed; `image_prompt()` wraps prompt text and images in the request shape
llama-server's /completion takes for multimodal input (``{"prompt_string": ..., "multimodal_data":
[base64, ...]}``, one media marker in the string per image).
"""

from __future__ import annotations

import base64
import os
import random
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.tinymodel import (
    _vocab,
    add_llama_tensors,
    add_vocab,
    open_writer,
    save_model,
    seeded_normal,
)


@dataclass(frozen=True)
class MmprojSpec:
    """Shape of a generated projector. `n_embd_text` must be the text model's `n_embd`."""

    n_embd_text: int = 64
    n_embd: int = 32  # vision encoder width
    n_head: int = 4
    n_ff: int = 48  # must differ from n_embd: clip.cpp guesses swapped up/down tensors otherwise
    n_layer: int = 2
    n_proj: int = 96  # the MLP projector's hidden width
    image_size: int = 32
    patch_size: int = 8
    seed: int = 99

    @property
    def n_image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def file_name(self) -> str:
        return (
            f"llama-sidecar-mmproj-mlp-s{self.seed}-v{self.n_embd}x{self.n_layer}"
            f"-i{self.image_size}p{self.patch_size}-to{self.n_embd_text}.gguf"
        )


class _Init:
    """Float32 tensors drawn from one seeded generator."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        self.np = np
        self.normal = seeded_normal(seed)

    def zeros(self, n: int) -> Any:
        return self.np.zeros(n, dtype=self.np.float32)

    def ones(self, n: int) -> Any:
        return self.np.ones(n, dtype=self.np.float32)


def _clip_writer(path: Path, name: str, projector: str, *, d: int, ff: int, n_layer: int,
                 n_embd_text: int, n_head: int, eps: float, image_size: int,
                 patch_size: int) -> tuple[Any, Path]:
    """A GGUFWriter for a vision projector with the keys every clip.cpp projector reads, on
    a temporary file beside `path` (see open_writer())."""
    import gguf

    w, tmp = open_writer(path, "clip")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", projector)
    w.add_uint32("clip.vision.embedding_length", d)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.block_count", n_layer)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", eps)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch_size)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    return w, tmp


def _add_encoder_blocks(w: Any, init: _Init, n_layer: int, d: int, ff: int) -> None:
    """The ViT blocks: pre-norms, attention and a two-layer MLP, all with biases."""
    for i in range(n_layer):
        blk = f"v.blk.{i}"
        for norm in ("ln1", "ln2"):
            w.add_tensor(f"{blk}.{norm}.weight", init.ones(d))
            w.add_tensor(f"{blk}.{norm}.bias", init.zeros(d))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{blk}.{name}.weight", init.normal((d, d), d**-0.5))
            w.add_tensor(f"{blk}.{name}.bias", init.zeros(d))
        w.add_tensor(f"{blk}.ffn_up.weight", init.normal((ff, d), d**-0.5))
        w.add_tensor(f"{blk}.ffn_up.bias", init.zeros(ff))
        w.add_tensor(f"{blk}.ffn_down.weight", init.normal((d, ff), ff**-0.5))
        w.add_tensor(f"{blk}.ffn_down.bias", init.zeros(d))


def write_mmproj(path: str | os.PathLike[str], spec: MmprojSpec = MmprojSpec()) -> Path:
    """Write the projector described by `spec` to `path` (atomically) and return the path."""
    path = Path(path)
    init = _Init(spec.seed)
    d, ff, p = spec.n_embd, spec.n_ff, spec.patch_size
    w, tmp = _clip_writer(path, "llama-sidecar tiny mmproj random", "mlp", d=d, ff=ff,
                     n_layer=spec.n_layer, n_embd_text=spec.n_embd_text, n_head=spec.n_head,
                     eps=1e-5, image_size=spec.image_size, patch_size=p)

    # numpy shapes are ggml's ne reversed: the patch convolution's kernel is ne [p, p, 3, d]
    w.add_tensor("v.patch_embd.weight", init.normal((d, 3, p, p), (3 * p * p) ** -0.5))
    w.add_tensor("v.patch_embd.bias", init.zeros(d))
    w.add_tensor("v.position_embd.weight", init.normal((spec.n_image_tokens, d), 0.1))
    _add_encoder_blocks(w, init, spec.n_layer, d, ff)
    # the LLaVA MLP: mm.0 (d -> n_proj), GELU, mm.2 (n_proj -> the text model's n_embd); the
    # output rows get the spread of the text model's token embeddings (std 1)
    w.add_tensor("mm.0.weight", init.normal((spec.n_proj, d), d**-0.5))
    w.add_tensor("mm.0.bias", init.zeros(spec.n_proj))
    w.add_tensor("mm.2.weight",
                 init.normal((spec.n_embd_text, spec.n_proj), 2 * spec.n_proj**-0.5))
    w.add_tensor("mm.2.bias", init.zeros(spec.n_embd_text))
    return save_model(w, tmp, path)


def png(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG of random pixels (8 bits per channel, no filtering), deterministic per seed."""
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + rng.randbytes(3 * width) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def image_prompt(parts: list[str | bytes], marker: str) -> dict[str, Any]:
    """A /completion "prompt" object from text (str) and PNG images (bytes), in order.

    `marker` is the server's media marker: llama-server draws a random one at start (unless
    LLAMA_MEDIA_MARKER pins it) and reports it as "media_marker" in /props."""
    text = "".join(p if isinstance(p, str) else marker for p in parts)
    images = [base64.b64encode(p).decode("ascii") for p in parts if isinstance(p, bytes)]
    return {"prompt_string": text, "multimodal_data": images}


# ---- an M-RoPE pair: Qwen2-VL ------------------------------------------------------------------
# With M-RoPE (multi-section rotary positions) an image's cells do not advance the position one
# by one: an image of h x w merged patches spans max(h, w) positions for h * w cells. The pair
# below is the smallest one llama.cpp runs that way: a text model of architecture "qwen2vl"
# (llama's tensors, M-RoPE with `rope.dimension_sections`) and a "qwen2vl_merger" projector
# (a ViT with two patch convolutions, M-RoPE inside the encoder, and an MLP over each 2x2 group
# of patches). Images are resized to multiples of 2 * patch_size; a 64x32 image with 8-pixel
# patches is 8x4 patches, merged 4x2: 8 cells spanning 4 positions.


def write_qwen2vl_text(path: str | os.PathLike[str], n_embd: int = 64, n_layer: int = 2,
                       n_head: int = 4, n_ff: int = 128, seed: int = 77) -> Path:
    """A tiny random Qwen2-VL text model with the shared test vocabulary."""
    import gguf

    path = Path(path)
    normal = seeded_normal(seed)
    n_vocab, d, head_dim = len(_vocab()[0]), n_embd, n_embd // n_head
    w, tmp = open_writer(path, "qwen2vl")
    w.add_name("llama-sidecar tiny qwen2vl random")
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(head_dim)
    # sections of the rotary pairs (head_dim / 2 in all): temporal, height, width, unused
    half = head_dim // 2
    w.add_rope_dimension_sections([half - 2 * (half // 3), half // 3, half // 3, 0])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_vocab(w)

    add_llama_tensors(w, normal, n_vocab, d, n_ff, n_layer)
    return save_model(w, tmp, path)


def write_qwen2vl_mmproj(path: str | os.PathLike[str], n_embd_text: int = 64, n_embd: int = 32,
                         n_head: int = 4, n_ff: int = 48, n_layer: int = 2, n_proj: int = 96,
                         patch_size: int = 8, seed: int = 78) -> Path:
    """A tiny random "qwen2vl_merger" projector whose output rows have `n_embd_text` values."""
    path = Path(path)
    init = _Init(seed)
    d, ff, p = n_embd, n_ff, patch_size
    assert (d // n_head) % 4 == 0, "the encoder's M-RoPE splits a head in four sections"
    w, tmp = _clip_writer(path, "llama-sidecar tiny qwen2vl mmproj random", "qwen2vl_merger", d=d,
                     ff=ff, n_layer=n_layer, n_embd_text=n_embd_text, n_head=n_head, eps=1e-6,
                     image_size=560, patch_size=p)  # the image size is only a warmup size here

    # two patch convolutions (Qwen2-VL's temporal pair of frames), no bias, no position table
    w.add_tensor("v.patch_embd.weight", init.normal((d, 3, p, p), (3 * p * p) ** -0.5))
    w.add_tensor("v.patch_embd.weight.1", init.normal((d, 3, p, p), (3 * p * p) ** -0.5))
    _add_encoder_blocks(w, init, n_layer, d, ff)
    w.add_tensor("v.post_ln.weight", init.ones(d))
    w.add_tensor("v.post_ln.bias", init.zeros(d))
    # the merger: each 2x2 group of patches (4 * d values) -> n_proj -> the text model's n_embd
    w.add_tensor("mm.0.weight", init.normal((n_proj, 4 * d), (4 * d) ** -0.5))
    w.add_tensor("mm.0.bias", init.zeros(n_proj))
    w.add_tensor("mm.2.weight", init.normal((n_embd_text, n_proj), 2 * n_proj**-0.5))
    w.add_tensor("mm.2.bias", init.zeros(n_embd_text))
    return save_model(w, tmp, path)

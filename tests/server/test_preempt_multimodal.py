"""KV preemption with images in the prompt.

A slot whose prompt holds an image keeps, beside text cells, cells decoded from the image's
embedding rows: they cannot be re-made from token ids. A park by swap copies them out and back
like any other cells; a park by recompute re-prefills the slot from its tokens, which an image
chunk is not, so such a generating slot must never be parked by recompute, while a text-only
slot on the same server (an mmproj loaded) still can be.

No multimodal model can be fetched here, so the models are tiny random-weight pairs written by
tests/support/tinymm.py, each run by every test:

* "llava": the generated tiny llama text model and an "mlp" (LLaVA-1.5) projector; an image is
  16 cells at 16 consecutive positions;
* "qwen2vl": a Qwen2-VL text model and a "qwen2vl_merger" projector, with M-RoPE: an image of
  h x w merged patches is h * w cells spanning max(h, w) positions (24 cells, 8 positions for
  the 128x48 images here), so a slot's cell count and its next position differ.

Images are small random PNGs made by hand. llama-server draws a random media marker at start:
the prompts read it from /props.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.paths import cache_dir
from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BASE,
    LAST_RESORT_LINE,
    PARK,
    PARK_LINE,
    complete,
    complete_many,
    count_lines,
    robust_prompts,
    tie_free,
    wait_for,
)
from tests.server.test_preempt_kv import assert_same, assert_settled
from tests.support.llama import LlamaServer
from tests.support.tinymm import (
    MmprojSpec,
    image_prompt,
    png,
    write_mmproj,
    write_qwen2vl_mmproj,
    write_qwen2vl_text,
)
from tests.support.tinymodel import SPECS, cached, ensure_model

pytestmark = [pytest.mark.server]

REFUSED_LINE = "preempt: a slot with multimodal chunks cannot be parked by recompute"
MTMD_FAILED_LINE = "failed to process mtmd chunk"
FAIL_SAVE = {"LLAMA_SERVER_PREEMPT_FAIL_SAVE": "1"}
EVERY_8 = {"LLAMA_SERVER_PREEMPT_EVERY": "8"}
PLANNER_OFF = {"LLAMA_SERVER_PREEMPT_PLANNER": "off"}
IMAGE_W, IMAGE_H = 128, 48
# The CPU flash-attention kernel (on by default, -fa auto) gives results that depend on the batch
# shape: a prompt split into other ubatches, or a generation step decoded alone instead of beside
# another slot's prompt chunk, moves the top-two logprob gap by up to ~0.011 here, with or
# without a park (stock llama-server, solo vs two prompts together at -c 512: up to 0.006; with
# -fa off, 2e-4 at most). Prompts whose solo answer must survive such a change keep their gaps
# above it.
FA_NOISE_GAP = 0.05


@dataclass(frozen=True)
class Pair:
    """A text model and the projector that feeds it images."""

    name: str
    text: Path
    mmproj: Path

    def args(self, *more: str) -> list[str]:
        return [*BASE, *PARK, "--mmproj", str(self.mmproj), *more]


@pytest.fixture(scope="session", params=["llava", "qwen2vl"])
def pair(request: pytest.FixtureRequest) -> Pair:
    models = cache_dir() / "models"
    if request.param == "llava":
        spec = MmprojSpec(n_embd_text=SPECS["tiny"].n_embd)
        return Pair("llava", ensure_model(models, "tiny"),
                    cached(models / spec.file_name, lambda p: write_mmproj(p, spec)))
    return Pair(
        "qwen2vl",
        cached(models / "llama-sidecar-qwen2vl-s77-d64x2.gguf", write_qwen2vl_text),
        cached(models / "llama-sidecar-mmproj-qwen2vl_merger-s78-v32x2-to64.gguf",
               write_qwen2vl_mmproj),
    )


def props(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/props", timeout=10)
    r.raise_for_status()
    return dict(r.json())


def picture_prompt(url: str, seed: int, n_words: int = 0,
                   image_first: bool = False) -> dict[str, Any]:
    """Text, one random image, text, with `n_words` random words before the image (after it with
    `image_first`); deterministic per seed. The marker is the server's (see /props)."""
    marker = props(url)["media_marker"]
    rng = random.Random(seed)
    words = "".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7))) + " "
        for _ in range(n_words)
    )
    image = png(IMAGE_W, IMAGE_H, seed)
    if image_first:
        parts: list[str | bytes] = ["a picture: ", image, " " + words + "what is it?"]
    else:
        parts = [words + "a picture: ", image, " what is it?"]
    return image_prompt(parts, marker)


# image seeds whose greedy path has no near-tie, per (model, count, n_predict, first_seed, ...)
_ROBUST: dict[tuple[Any, ...], list[int]] = {}


def robust_picture_prompts(url: str, count: int, n_predict: int, first_seed: int = 0,
                           n_words: int = 0, image_first: bool = False,
                           min_gap: float = 0.02) -> list[dict[str, Any]]:
    """`count` image prompts whose greedy continuation never has its top two logprobs closer than
    `min_gap` (see preempt_helpers.robust_prompts: batch shapes move logits by float noise). The
    seeds found are the same for every server with the same models; the prompts carry `url`'s
    media marker."""
    key = (props(url)["model_path"], count, n_predict, first_seed, n_words, image_first)
    if key not in _ROBUST:
        seeds: list[int] = []
        for seed in range(first_seed, first_seed + 100):
            if tie_free(url, picture_prompt(url, seed, n_words, image_first), n_predict, min_gap):
                seeds.append(seed)
            if len(seeds) == count:
                break
        assert len(seeds) == count, f"no {count} tie-free image prompts for {n_predict} tokens"
        _ROBUST[key] = seeds
    return [picture_prompt(url, seed, n_words, image_first) for seed in _ROBUST[key]]


def wait_log(srv: LlamaServer, marker: str, n: int = 1) -> str:
    """The server's log once `marker` is in it `n` times (the log reaches its file a little after
    the response that followed it)."""
    return str(wait_for(lambda: count_lines(srv.log_text(), marker) >= n and srv.log_text(),
                        timeout=10, what=f"{n} log line(s) with {marker!r}"))


def text_prompts(url: str, pair: Pair, count: int, n_predict: int) -> list[list[int]]:
    """`count` tie-free 8-token prompts (preempt_helpers.robust_prompts, whose cache is not keyed
    by model: the Qwen2-VL pair searches from another first seed than the tiny llama model's)."""
    return robust_prompts(url, count, 8, n_predict, first_seed=0 if pair.name == "llava" else 1000)


def test_the_image_reaches_the_model(start_server: StartServer, pair: Pair) -> None:
    """The generated projector loads, an image prompt is answered, and the image matters: the
    same text with another image gives other tokens, the same image the same ones. Without this
    the tests below could pass with images that the model never sees."""
    srv = start_server(model=pair.text, args=pair.args("-c", "1024", "-np", "2"))
    wait_log(srv, "loaded multimodal model")
    assert props(srv.url)["modalities"]["vision"]
    first = complete(srv.url, picture_prompt(srv.url, 1), 24)
    again = complete(srv.url, picture_prompt(srv.url, 1), 24)
    other = complete(srv.url, picture_prompt(srv.url, 2), 24)
    assert_same(again, first, 24)
    assert other.ok, other.error
    assert other.tokens != first.tokens
    # BOS, the text around the marker, and the image's cells (16 llava, 24 qwen2vl)
    assert first.timings["prompt_n"] >= 16 + 2, first.timings
    assert first.preempt == {"parks": 0, "recomputes": 0}, first.preempt


def test_forced_swap_parks_of_an_image_slot_change_nothing(start_server: StartServer,
                                                           pair: Pair) -> None:
    """A park every 8 generated tokens, by swap: the image's cells go to host RAM and come back,
    and the tokens are those of a server that never parks."""
    args = pair.args("-c", "1024", "-np", "2")
    plain = start_server(model=pair.text, args=args)
    forced = start_server(model=pair.text, args=args, env=EVERY_8)
    wait_log(forced, "LLAMA_SERVER_PREEMPT_EVERY = 8")

    for seed in (3, 4):
        ref = complete(plain.url, picture_prompt(plain.url, seed), 64)
        got = complete(forced.url, picture_prompt(forced.url, seed), 64)
        assert_same(got, ref, 64)
        assert ref.preempt == {"parks": 0, "recomputes": 0}, ref.preempt
        assert got.preempt["parks"] >= 6, got.preempt
        assert got.preempt["recomputes"] == 0, got.preempt
    log = wait_log(forced, PARK_LINE, 12)
    assert REFUSED_LINE not in log
    m = assert_settled(forced.url)
    assert m["n_preempt_total"] >= 12
    assert m["preempt_recompute_total"] == 0


def test_an_image_slot_is_never_parked_by_recompute(start_server: StartServer,
                                                    pair: Pair) -> None:
    """Host copies fail, so a park would have to go by recompute, and a generating slot holding
    an image chunk cannot be re-prefilled from token ids: it is not parked (the server says so)
    and finishes with the tokens of a server that never parks."""
    args = pair.args("-c", "1024", "-np", "2")
    plain = start_server(model=pair.text, args=args)
    forced = start_server(model=pair.text, args=args, env={**EVERY_8, **FAIL_SAVE})
    wait_log(forced, "LLAMA_SERVER_PREEMPT_FAIL_SAVE = 1")

    ref = complete(plain.url, picture_prompt(plain.url, 5), 64)
    got = complete(forced.url, picture_prompt(forced.url, 5), 64)
    assert_same(got, ref, 64)
    assert got.preempt == {"parks": 0, "recomputes": 0}, got.preempt
    wait_log(forced, REFUSED_LINE)
    m = assert_settled(forced.url)
    assert m["n_preempt_total"] == 0, m


def test_a_text_slot_beside_an_mmproj_is_parked_by_recompute(start_server: StartServer,
                                                             pair: Pair) -> None:
    """The refusal is for slots that hold an image, not for every slot of a server with an mmproj
    loaded (text-only slots once fell back to the context error there): a text-only request
    there is parked by recompute each 8 tokens and gives the tokens of an unparked run."""
    args = pair.args("-c", "1024", "-np", "2")
    plain = start_server(model=pair.text, args=args)
    forced = start_server(model=pair.text, args=args, env={**EVERY_8, **FAIL_SAVE})
    prompt = text_prompts(plain.url, pair, 1, 64)[0]

    ref = complete(plain.url, prompt, 64)
    got = complete(forced.url, prompt, 64)
    assert_same(got, ref, 64)
    assert got.preempt["parks"] >= 6, got.preempt
    assert got.preempt["recomputes"] == got.preempt["parks"], got.preempt
    assert REFUSED_LINE not in forced.log_text()
    m = assert_settled(forced.url)
    assert m["preempt_recompute_total"] == m["n_preempt_total"] >= 6, m


def test_recompute_refusal_is_per_slot(start_server: StartServer, pair: Pair) -> None:
    """An image prompt and a text prompt in one request, host copies failing: the image slot is
    never parked, the text slot beside it is parked by recompute, and both give the tokens of
    their unparked solo runs."""
    args = pair.args("-c", "1024", "-np", "2")
    plain = start_server(model=pair.text, args=args)
    forced = start_server(model=pair.text, args=args, env={**EVERY_8, **FAIL_SAVE})
    text = text_prompts(plain.url, pair, 1, 64)[0]
    ref_picture = complete(plain.url, robust_picture_prompts(plain.url, 1, 64)[0], 64)
    ref_text = complete(plain.url, text, 64)

    prompts: list[Any] = [robust_picture_prompts(forced.url, 1, 64)[0], text]
    got_picture, got_text = complete_many(forced.url, prompts, 64)
    assert_same(got_picture, ref_picture, 64)
    assert_same(got_text, ref_text, 64)
    assert got_picture.preempt == {"parks": 0, "recomputes": 0}, got_picture.preempt
    assert got_text.preempt["parks"] >= 6, got_text.preempt
    assert got_text.preempt["recomputes"] == got_text.preempt["parks"], got_text.preempt
    wait_log(forced, REFUSED_LINE)
    m = assert_settled(forced.url)
    assert m["preempt_recompute_total"] == m["n_preempt_total"] >= 6, m


@pytest.mark.parametrize("planner", ["on", "off"])
@pytest.mark.parametrize("kind", ["images", "text"])
def test_generations_overflowing_together_beside_an_mmproj(start_server: StartServer,
                                                           pair: Pair, kind: str,
                                                           planner: str) -> None:
    """Two generations that each fit the pool but not together, on a server with an mmproj: one
    is parked (by swap; with an image, its image cells too) while the other grows, and both end
    with their solo answers. With the planner off only the retry ladder's last resort parks."""
    srv = start_server(model=pair.text, args=pair.args("-c", "256", "-np", "2"),
                       env={} if planner == "on" else PLANNER_OFF)
    n_predict = 160
    prompts: list[Any] = (robust_picture_prompts(srv.url, 2, n_predict, first_seed=10)
                          if kind == "images" else text_prompts(srv.url, pair, 2, n_predict))
    solo = [complete(srv.url, p, n_predict) for p in prompts]
    sizes = [c.timings["prompt_n"] for c in solo]
    assert max(sizes) + n_predict <= 256 - 8 < sum(sizes) + 2 * n_predict, sizes
    together = complete_many(srv.url, prompts, n_predict)
    for got, ref in zip(together, solo, strict=True):
        assert_same(got, ref, n_predict)
        assert got.final
        assert not got.final["truncated"]
    assert sum(c.preempt["parks"] for c in together) >= 1
    assert sum(c.preempt["recomputes"] for c in together) == 0
    log = wait_log(srv, LAST_RESORT_LINE) if planner == "off" else srv.log_text()
    assert MTMD_FAILED_LINE not in log
    m = assert_settled(srv.url)
    assert m["n_preempt_total"] >= 1


@pytest.mark.parametrize("image_first", [False, True], ids=["image-last", "image-first"])
@pytest.mark.parametrize("planner", ["on", "off"])
def test_image_prompts_prefilled_in_chunks_overflowing_together(start_server: StartServer,
                                                                pair: Pair, planner: str,
                                                                image_first: bool) -> None:
    """Two long prompts with an image each, prefilled in 64-token batches, that fit the pool one
    at a time but not together. The batch builder decodes an image chunk on its own, on top of
    the batch: the planner must make room for it too, or the image's decode
    fails ("failed to process mtmd chunk"). With the planner off the retry ladder's last resort
    meets a prompt in progress whose cells hold an image, and its rewind must not cut the image
    (with M-RoPE a cut counted in positions lands inside an image: it threw out of decode() and
    ended every slot). Both requests finish with their solo answers."""
    srv = start_server(model=pair.text,
                       args=pair.args("-c", "256", "-np", "2", "-b", "64", "-ub", "64"),
                       env={} if planner == "on" else PLANNER_OFF)
    n_words = (30, 20) if pair.name == "llava" else (24, 14)
    prompts = [
        *robust_picture_prompts(srv.url, 1, 40, first_seed=20, n_words=n_words[0],
                                image_first=image_first, min_gap=FA_NOISE_GAP),
        *robust_picture_prompts(srv.url, 1, 40, first_seed=30, n_words=n_words[1],
                                image_first=image_first, min_gap=FA_NOISE_GAP),
    ]
    solo = [complete(srv.url, p, 40) for p in prompts]
    sizes = [c.timings["prompt_n"] for c in solo]
    # each fits the pool with its 40 tokens, both do not
    assert max(sizes) + 40 <= 256 - 8 < sum(sizes) + 2 * 40, sizes
    together = complete_many(srv.url, prompts, 40)
    for got, ref in zip(together, solo, strict=True):
        assert_same(got, ref, 40)
    log = wait_log(srv, LAST_RESORT_LINE) if planner == "off" else srv.log_text()
    assert MTMD_FAILED_LINE not in log
    if planner == "on":
        assert sum(c.preempt["parks"] for c in together) >= 1
    assert_settled(srv.url)

"""KV preemption of a request served with a LoRA adapter (the replay of a recompute goes
through the prompt path, aLoRA included).

An activated LoRA (aLoRA) changes what the cells of a prompt hold: llama-server decodes the part
before the adapter's invocation tokens without the adapter and the rest with it. A park by
recompute re-prefills the slot from its tokens; unless the replay splits at the invocation
exactly as the prompt did, the re-made cells before it are the adapted model's, not the base
model's, and every token after the restore comes from a different context while the response
reports success. A plain LoRA applies to every token and has no split.

The adapters are random-weight ones for the generated tiny model (tests/support/tinylora.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.paths import cache_dir
from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BASE,
    PARK,
    Completion,
    complete,
    tie_free,
    token_prompt,
)
from tests.server.test_preempt_kv import assert_same, assert_settled
from tests.support.tinylora import write_lora
from tests.support.tinymodel import cached

pytestmark = [pytest.mark.server]

# two text tokens of the shared vocabulary that token_prompt() also draws; the prompts below are
# made so that the pair occurs once, where it is put
INVOKE = (300, 301)
N_PREDICT = 48
ARGS = [*BASE, *PARK, "-c", "512", "-np", "2"]
EVERY_8 = {"LLAMA_SERVER_PREEMPT_EVERY": "8"}
FAIL_SAVE = {"LLAMA_SERVER_PREEMPT_FAIL_SAVE": "1"}


def adapter(kind: str) -> Path:
    """The cached adapter: "alora" (invoked by INVOKE) or "lora" (the same weights, always on)."""
    models = cache_dir() / "models"
    if kind == "alora":
        return cached(models / "llama-sidecar-tiny-alora-s99-r8.gguf",
                      lambda p: write_lora(p, invocation_tokens=INVOKE))
    return cached(models / "llama-sidecar-tiny-lora-s99-r8.gguf", write_lora)


def invoked_prompt(seed: int) -> list[int]:
    """24 tokens before the invocation (most of the prompt, so that their cells matter), the
    invocation, 4 after it."""
    def without(n: int, s: int) -> list[int]:
        return [t for t in token_prompt(n + 8, s) if t not in INVOKE][:n]
    return [*without(24, seed), *INVOKE, *without(4, seed + 1000)]


def robust_invoked_prompt(url: str, first_seed: int = 0, min_gap: float = 0.02) -> list[int]:
    """An invoked prompt whose greedy continuation on `url` has no near-tie (see
    preempt_helpers.robust_prompts)."""
    for seed in range(first_seed, first_seed + 100):
        prompt = invoked_prompt(seed)
        if tie_free(url, prompt, N_PREDICT, min_gap):
            return prompt
    raise AssertionError("no tie-free invoked prompt")


def test_the_adapters_matter(start_server: StartServer) -> None:
    """Without this the tests below could pass with an adapter that changes nothing: the plain
    LoRA changes the base model's tokens, and the aLoRA's differ from both, so the cells before
    the invocation (the base model's under the aLoRA, the adapted model's under the LoRA) decide
    the answer."""
    base = start_server(args=ARGS)
    lora = start_server(args=[*ARGS, "--lora", str(adapter("lora"))])
    alora = start_server(args=[*ARGS, "--lora", str(adapter("alora"))])
    assert "alora" in alora.log_text().lower()

    prompt = invoked_prompt(0)
    got = {name: complete(srv.url, prompt, N_PREDICT)
           for name, srv in (("base", base), ("lora", lora), ("alora", alora))}
    for c in got.values():
        assert c.ok, c.error
    assert got["lora"].tokens != got["base"].tokens
    assert got["alora"].tokens != got["base"].tokens
    assert got["alora"].tokens != got["lora"].tokens

    # an aLoRA request without the invocation runs the base model
    plain = token_prompt(28, 7)
    assert not set(INVOKE) & set(plain)
    assert_same(complete(alora.url, plain, N_PREDICT), complete(base.url, plain, N_PREDICT),
                N_PREDICT)


@pytest.mark.parametrize("kind", ["alora", "lora"])
@pytest.mark.parametrize("how", ["recompute", "swap"])
def test_forced_parks_of_an_adapter_request_change_nothing(start_server: StartServer, kind: str,
                                                           how: str) -> None:
    """A park every 8 generated tokens, by recompute (every save fails) or by swap: the tokens are
    those of a server that never parks. Before the replay went through the prompt path's batch
    filling, a recompute re-made an aLoRA request's pre-invocation cells with the adapter on."""
    args = [*ARGS, "--lora", str(adapter(kind))]
    plain = start_server(args=args)
    forced = start_server(args=args, env={**EVERY_8, **(FAIL_SAVE if how == "recompute" else {})})

    prompt = robust_invoked_prompt(plain.url)
    ref = complete(plain.url, prompt, N_PREDICT)
    got: Completion = complete(forced.url, prompt, N_PREDICT)
    assert_same(got, ref, N_PREDICT)
    assert ref.preempt == {"parks": 0, "recomputes": 0}, ref.preempt
    assert got.preempt["parks"] >= 4, got.preempt
    if how == "recompute":
        assert got.preempt["recomputes"] == got.preempt["parks"], got.preempt
    else:
        assert got.preempt["recomputes"] == 0, got.preempt
    assert_settled(forced.url)

"""KV preemption with a hybrid cache: attention cells plus a recurrent state.

A hybrid model keeps two kinds of memory per sequence: attention K/V cells that grow with the
context and a fixed-size recurrent state. A park must take both and a restore must put both back,
or the sequence resumes with a state from someone else's tokens. The model here is a tiny
random-weight Jamba (one Mamba layer, one attention layer) written with the `gguf` package, the
same vocabulary as the other generated test models. The checks are the ones the dense model gets:
forced swap parks and forced recompute parks change no token, and two generations that overflow
the pool together both finish with their solo answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar.paths import cache_dir
from tests.conftest import StartServer
from tests.server.preempt_helpers import BASE, PARK, complete, token_prompt
from tests.server.test_preempt_kv import assert_same, assert_settled, solo_then_together
from tests.support.tinymodel import (
    _vocab,
    add_vocab,
    cached,
    open_writer,
    save_model,
    seeded_normal,
)

pytestmark = [pytest.mark.server]


def write_jamba(path: Path, layers: str = "ma", n_embd: int = 64, n_head: int = 4,
                n_ff: int = 128, seed: int = 7) -> Path:
    """A tiny random Jamba: `layers` names each block, `m` Mamba, `a` attention."""
    import gguf
    import numpy as np

    normal = seeded_normal(seed)
    n_vocab, d = len(_vocab()[0]), n_embd
    d_inner, d_state, d_conv, dt_rank = 2 * d, 16, 4, 8  # Jamba needs d_inner == 2 * n_embd

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    w, tmp = open_writer(path, "jamba")
    w.add_name("llama-sidecar tiny jamba random")
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_block_count(len(layers))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    # a block without K/V heads is a Mamba block: that is how Jamba tells them apart
    w.add_head_count_kv([0 if kind == "m" else n_head for kind in layers])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_vocab(w)

    # numpy shapes are ggml's ne reversed
    w.add_tensor("token_embd.weight", normal((n_vocab, d), 1.0))
    for i, kind in enumerate(layers):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", ones(d))
        if kind == "m":
            w.add_tensor(f"{blk}.ssm_in.weight", normal((2 * d_inner, d), d**-0.5))
            w.add_tensor(f"{blk}.ssm_conv1d.weight", normal((d_inner, d_conv), 0.5))
            w.add_tensor(f"{blk}.ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
            w.add_tensor(f"{blk}.ssm_x.weight",
                         normal((dt_rank + 2 * d_state, d_inner), d_inner**-0.5))
            w.add_tensor(f"{blk}.ssm_dt_norm.weight", ones(dt_rank))
            w.add_tensor(f"{blk}.ssm_dt.weight", normal((d_inner, dt_rank), dt_rank**-0.5))
            w.add_tensor(f"{blk}.ssm_dt.bias", np.full(d_inner, -2.0, dtype=np.float32))
            w.add_tensor(f"{blk}.ssm_b_norm.weight", ones(d_state))
            w.add_tensor(f"{blk}.ssm_c_norm.weight", ones(d_state))
            w.add_tensor(f"{blk}.ssm_a",
                         -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1)))
            w.add_tensor(f"{blk}.ssm_d", ones(d_inner))
            w.add_tensor(f"{blk}.ssm_out.weight", normal((d, d_inner), d_inner**-0.5))
        else:
            for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
                w.add_tensor(f"{blk}.{name}.weight", normal((d, d), d**-0.5))
        w.add_tensor(f"{blk}.ffn_norm.weight", ones(d))
        w.add_tensor(f"{blk}.ffn_gate.weight", normal((n_ff, d), d**-0.5))
        w.add_tensor(f"{blk}.ffn_up.weight", normal((n_ff, d), d**-0.5))
        w.add_tensor(f"{blk}.ffn_down.weight", normal((d, n_ff), n_ff**-0.5))
    w.add_tensor("output_norm.weight", ones(d))
    w.add_tensor("output.weight", normal((n_vocab, d), 1.0))
    return save_model(w, tmp, path)


@pytest.fixture(scope="session")
def jamba_model() -> Path:
    return cached(cache_dir() / "models" / "llama-sidecar-jamba-s7-d64-ma.gguf", write_jamba)


@pytest.mark.parametrize("fail_save", [False, True], ids=["swap", "recompute"])
def test_forced_parks_of_a_hybrid_cache_change_nothing(start_server: StartServer,
                                                      jamba_model: Path, fail_save: bool) -> None:
    """A park every 8 tokens, by swap (both parts copied out and back) or by recompute (both
    dropped and re-prefilled): the same tokens as without parks."""
    args = [*BASE, *PARK, "-c", "512", "-np", "2"]
    plain = start_server(model=jamba_model, args=args)
    env = {"LLAMA_SERVER_PREEMPT_EVERY": "8"}
    if fail_save:
        env["LLAMA_SERVER_PREEMPT_FAIL_SAVE"] = "1"
    forced = start_server(model=jamba_model, args=args, env=env)
    assert "KV preemption: on" in forced.log_text()

    for seed in (30, 31):
        prompt = token_prompt(8, seed)
        ref = complete(plain.url, prompt, 64)
        got = complete(forced.url, prompt, 64)
        assert_same(got, ref, 64)
        assert got.preempt["parks"] >= 6, got.preempt
        assert got.preempt["recomputes"] == (got.preempt["parks"] if fail_save else 0), got.preempt
    m = assert_settled(forced.url)
    assert m["n_preempt_total"] >= 12


def test_hybrid_generations_overflowing_together_both_finish(start_server: StartServer,
                                                             jamba_model: Path) -> None:
    """Two generations that each fit the pool but not together: one is parked while the other
    grows, and both end with their solo answers."""
    srv = start_server(model=jamba_model, args=[*BASE, *PARK, "-c", "256", "-np", "2"])
    prompts = [token_prompt(8, 40), token_prompt(8, 41)]
    solo, together = solo_then_together(srv.url, prompts, 200)
    for got, ref in zip(together, solo, strict=True):
        assert_same(got, ref, 200)
    assert sum(c.preempt["parks"] for c in together) >= 1
    assert_settled(srv.url)


@pytest.mark.parametrize("batch", [512, 64], ids=["generating", "prompt-chunks"])
def test_hybrid_last_resort(start_server: StartServer, jamba_model: Path, batch: int) -> None:
    """The planner off, so only the retry ladder's last resort parks. With 64-token batches the
    last resort meets a prompt in progress: a recurrent state cannot be cut back to a chunk
    boundary, so that prompt must be parked whole (or its chunk redone from the start), never
    resumed from a state that already saw the dropped chunk."""
    srv = start_server(model=jamba_model,
                       args=[*BASE, *PARK, "-c", "256", "-np", "2", "-b", str(batch),
                             "-ub", str(batch)],
                       env={"LLAMA_SERVER_PREEMPT_PLANNER": "off"})
    if batch == 64:
        prompts, n_predict = [token_prompt(200, 42), token_prompt(150, 43)], 40
    else:
        prompts, n_predict = [token_prompt(8, 42), token_prompt(8, 43)], 160
    solo, together = solo_then_together(srv.url, prompts, n_predict)
    for got, ref in zip(together, solo, strict=True):
        assert_same(got, ref, n_predict)
    assert "preempted as a last resort" in srv.log_text()
    assert_settled(srv.url)


@pytest.mark.parametrize("fail_save", [False, True], ids=["swap", "recompute"])
def test_parks_keep_the_hybrid_checkpoints(start_server: StartServer, jamba_model: Path,
                                           fail_save: bool) -> None:
    """A recurrent state cannot be cut back, so a next turn that leaves the cached tokens early
    resumes from a context checkpoint made during the first prompt. A park must leave those
    checkpoints usable (a recompute re-fills the very tokens they were taken from): the next turn
    reuses as much of its prompt as on a server that never parked."""
    args = [*BASE, *PARK, "-c", "512", "-np", "2"]
    env = {"LLAMA_SERVER_PREEMPT_EVERY": "8"}
    if fail_save:
        env["LLAMA_SERVER_PREEMPT_FAIL_SAVE"] = "1"
    first_turn, next_turn = token_prompt(100, 50), token_prompt(100, 50)[:96] + token_prompt(8, 51)
    cached: dict[str, int] = {}
    for label, srv in (("plain", start_server(model=jamba_model, args=args)),
                       ("parked", start_server(model=jamba_model, args=args, env=env))):
        first = complete(srv.url, first_turn, 32, id_slot=0, cache_prompt=True)
        assert first.ok, first.error
        assert (first.preempt["parks"] >= 3) == (label == "parked"), first.preempt
        second = complete(srv.url, next_turn, 4, id_slot=0, cache_prompt=True)
        assert second.ok, second.error
        assert second.final is not None
        cached[label] = second.final["timings"]["cache_n"]
    assert cached["plain"] > 0, "no checkpoint was used on the server without parks"
    assert cached["parked"] == cached["plain"], cached

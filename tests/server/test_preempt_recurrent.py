"""KV preemption with a pure recurrent model.

A recurrent cache (Mamba) holds one fixed-size state per sequence, not cells that grow with the
context: there is nothing to park. With --preempt-ram set, such a server must say once at load
that preemption is off, serve every request without parks or notices, and still carry the
(zero) `preempt` record in every final response.

The model is a random-weight Mamba written here with the `gguf` package (the shared generator in
tests/support/tinymodel.py writes llama models only). Hybrid caches (attention plus recurrent state)
are covered by test_preempt_hybrid.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.paths import cache_dir
from tests.conftest import StartServer
from tests.server.preempt_helpers import BASE, PARK, metrics, token_prompt, wait_settled
from tests.server.test_preempt_defects import assert_complete, body, streamed
from tests.support.tinymodel import (
    _vocab,
    add_vocab,
    cached,
    open_writer,
    save_model,
    seeded_normal,
)

pytestmark = [pytest.mark.server]


def write_mamba(path: Path, n_embd: int = 64, n_layer: int = 2, seed: int = 99) -> Path:
    """A tiny random Mamba-1 model with the shared test vocabulary."""
    import gguf
    import numpy as np

    normal = seeded_normal(seed)
    n_vocab, d = len(_vocab()[0]), n_embd
    d_inner, d_state, d_conv, dt_rank = 2 * d, 16, 4, 8

    w, tmp = open_writer(path, "mamba")
    w.add_name("llama-sidecar tiny mamba random")
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_vocab(w)

    # numpy shapes are ggml's ne reversed
    w.add_tensor("token_embd.weight", normal((n_vocab, d), 1.0))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ssm_in.weight", normal((2 * d_inner, d), d**-0.5))
        w.add_tensor(f"blk.{i}.ssm_conv1d.weight", normal((d_inner, d_conv), 0.5))
        w.add_tensor(f"blk.{i}.ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ssm_x.weight", normal((dt_rank + 2 * d_state, d_inner),
                                                     d_inner**-0.5))
        w.add_tensor(f"blk.{i}.ssm_dt.weight", normal((d_inner, dt_rank), dt_rank**-0.5))
        w.add_tensor(f"blk.{i}.ssm_dt.bias", np.full(d_inner, -2.0, dtype=np.float32))
        a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
        w.add_tensor(f"blk.{i}.ssm_a", a)
        w.add_tensor(f"blk.{i}.ssm_d", np.ones(d_inner, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ssm_out.weight", normal((d, d_inner), d_inner**-0.5))
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    w.add_tensor("output.weight", normal((n_vocab, d), 1.0))
    return save_model(w, tmp, path)


@pytest.fixture(scope="session")
def mamba_model() -> Path:
    return cached(cache_dir() / "models" / "llama-sidecar-mamba-s99-d64x2.gguf", write_mamba)


def test_recurrent_model_is_served_without_preemption(start_server: StartServer,
                                                       mamba_model: Path) -> None:
    srv = start_server(model=mamba_model, args=[*BASE, *PARK, "-c", "256", "-np", "2"])
    log = srv.log_text()
    assert log.count("KV preemption is off: the model is recurrent") == 1, log[-3000:]

    # two prompts whose contexts together exceed -c: a recurrent state does not grow, so both
    # are served whole, without a park or a notice
    prompts = [token_prompt(8, 20), token_prompt(8, 21)]
    res = streamed(srv.url, body(prompts, 200))
    finals = assert_complete(res, 2, [8, 8], 200, multi_prompt=True)
    assert all(f["preempt"] == {"parks": 0, "recomputes": 0} for f in finals.values())
    assert not any(line.startswith(": preempt") or line.startswith(": resumed")
                   for line in res.lines())
    wait_settled(srv.url)
    assert metrics(srv.url)["n_preempt_total"] == 0

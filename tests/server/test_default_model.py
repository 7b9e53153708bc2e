"""The default model (Gemma 3 270M Q4_K_M) runs on the portable build: no SIGILL."""

from __future__ import annotations

import pytest

from sidecar.cli.model import default_model, server_args_for
from tests.conftest import StartServer

pytestmark = pytest.mark.server


def test_gemma_answers_a_chat_completion(start_server: StartServer) -> None:
    gemma = default_model(install=False)
    srv = start_server(model=gemma, args=["-c", "2048", "-np", "2", "--kv-unified", "-t", "2",
                                          *server_args_for(gemma)])
    r = srv.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hello in one word."}],
        "max_tokens": 16, "temperature": 0,
    })
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert text.strip()
    assert "<|im_" not in text, "ChatML markers: the Gemma chat template was not applied"
    assert body["usage"]["completion_tokens"] >= 1
    assert srv.alive(), srv.log_tail()

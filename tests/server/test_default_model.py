"""The default model (Gemma 3 270M Q4_K_M) runs on the portable build: no SIGILL."""

from __future__ import annotations

import pytest

from sidecar.cli.model import default_model
from tests.conftest import StartServer

pytestmark = pytest.mark.server


def test_gemma_answers_a_chat_completion(start_server: StartServer) -> None:
    srv = start_server(model=default_model(install=False),
                       args=["-c", "2048", "-np", "2", "--kv-unified", "-t", "2"])
    r = srv.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hello in one word."}],
        "max_tokens": 16, "temperature": 0,
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"].strip()
    assert body["usage"]["completion_tokens"] >= 1
    assert srv.alive(), srv.log_tail()

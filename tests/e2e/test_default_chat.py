"""`up` with no model option serves a chat model: a question asked through the sidecar
gets a chat answer, not template markers and not a base model's rambling."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sidecar.cli.model import SMOLLM2_FILE
from tests.support.sse_client import stream_sse
from tests.support.up import UpProcess, cmdline

pytestmark = [pytest.mark.server, pytest.mark.slow]

QUESTION = "What is the capital of France?"
MARKERS = ("<|im_start|>", "<|im_end|>", "<|", "|>", "<start_of_turn>", "<end_of_turn>")


def chat_body(stream: bool) -> dict[str, object]:
    # Greedy, so the answer is the same every run. (Without a system message SmolLM2's template
    # adds its own, and the greedy answer to this question then drifts into French.)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": QUESTION}]  # fmt: skip
    return {"messages": messages, "max_tokens": 48, "temperature": 0, "stream": stream}


def assert_chat_answer(text: str) -> None:
    assert text.strip(), "empty reply"
    assert not any(m in text for m in MARKERS), f"template markers in the reply: {text!r}"
    assert "Paris" in text, f"not an answer to {QUESTION!r}: {text!r}"


def test_up_default_model_answers_a_question(tmp_path: Path, llama_server_bin: Path) -> None:
    up = UpProcess(["--server-bin", str(llama_server_bin), "--parallel", "1",
                    "--ctx-size", "2048", "--", "-t", "1"], tmp_path)  # fmt: skip
    up.start(timeout=300)
    try:
        assert cmdline(up.server_pid()).split(" -m ")[1].split()[0].endswith(SMOLLM2_FILE)
        banner = up.text()
        assert f"model: {SMOLLM2_FILE}" in banner, banner
        assert "chat template: yes" in banner, banner
        assert banner.count("listening on") == 1, banner

        r = httpx.post(up.url + "/v1/chat/completions", json=chat_body(False), timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert_chat_answer(answer)

        log = stream_sse(up.url + "/v1/chat/completions", chat_body(True), timeout=120)
        assert log.status == 200, log.body()[-2000:]
        assert log.done, log.body()[-2000:]
        assert log.error is None, log.body()[-2000:]
        assert_chat_answer(log.content())
    finally:
        up.kill()

"""`llama-sidecar up` with the real patched llama-server, the tiny test model and the sidecar."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.procs import wait_until
from tests.support.sse_client import stream_sse
from tests.support.up import UpProcess, alive, cmdline

pytestmark = [pytest.mark.server, pytest.mark.slow]

RunUp = Callable[..., UpProcess]
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 24, "stream": True,
        "ignore_eos": True}  # fmt: skip


@pytest.fixture
def run_up(tmp_path: Path, llama_server_bin: Path, tiny_model: Path) -> Iterator[RunUp]:
    started: list[UpProcess] = []

    def make(*args: str, env: dict[str, str] | None = None) -> UpProcess:
        up = UpProcess(["--server-bin", str(llama_server_bin), "--model", str(tiny_model), *args],
                       tmp_path, env=env or {})  # fmt: skip
        started.append(up)
        return up.start(timeout=240)

    yield make
    for up in started:
        up.kill()


def test_up_tiny_serves_a_streamed_chat_and_sigterm_leaves_nothing(run_up: RunUp) -> None:
    up = run_up("--parallel", "2", "--ctx-size", "512", "--", "-t", "1")
    server = up.server_pid()
    argv = cmdline(server)
    for flag in ("--kv-unified", "--parallel 2", "--metrics", "--sse-ping-interval 1"):
        assert flag in argv
    log = stream_sse(up.url + "/v1/chat/completions", CHAT, timeout=120)
    assert log.status == 200, log.body()
    assert log.done, log.body()
    # Count tokens from the final timings: a random-weight model emits byte tokens, and the
    # server holds back a byte that leaves UTF-8 incomplete, so events != tokens.
    timings = next(ev["timings"] for ev in reversed(log.events) if "timings" in ev)
    assert log.content(), timings
    assert timings["predicted_n"] == CHAT["max_tokens"], timings
    # Both the sidecar's and llama-server's metrics answer.
    assert "llama_sidecar_requests_total" in httpx.get(up.metrics_url, timeout=10).text
    assert "llamacpp:" in httpx.get(up.server_url + "/metrics", timeout=10).text
    kids = up.children()
    assert server in kids
    assert len(kids) >= 2
    assert up.terminate(timeout=60) == 0
    assert [(p, cmdline(p)) for p in kids if alive(p)] == []


def test_up_restarts_a_killed_llama_server(run_up: RunUp) -> None:
    up = run_up("--parallel", "2", "--ctx-size", "512", "--", "-t", "1")
    first = up.server_pid()
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: "llama-server is back" in up.text(), 120, "the restart", every=0.2)
    assert up.server_pid() != first
    up.wait_healthy()
    log = stream_sse(up.url + "/v1/chat/completions", CHAT, timeout=120)
    assert log.status == 200, log.body()
    assert log.done, log.body()
    kids = up.children()
    assert up.terminate(timeout=60) == 0
    assert [p for p in kids if alive(p)] == []

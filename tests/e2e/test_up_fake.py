"""`llama-sidecar up` supervising a stand-in llama-server (no C++ build needed).

The same CLI, sidecar and signals as in production; only llama-server is replaced by the
fake of tests/support/fake_upstream.py (`fake_server_bin`), so these run everywhere and
fast. test_up.py repeats the key ones against the real patched server and the tiny model.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.procs import wait_until
from tests.support.sse_client import stream_sse
from tests.support.up import UpProcess, alive, cmdline

RunUp = Callable[..., UpProcess]


@pytest.fixture
def fake_model(tmp_path: Path) -> Path:
    p = tmp_path / "fake.gguf"
    p.write_bytes(b"GGUF")
    return p


@pytest.fixture
def run_up(tmp_path: Path, fake_model: Path, fake_server_bin: Path) -> Iterator[RunUp]:
    started: list[UpProcess] = []

    def make(*args: str, env: dict[str, str] | None = None, start: bool = True) -> UpProcess:
        up = UpProcess(["--server-bin", str(fake_server_bin), "--model", str(fake_model), *args],
                       tmp_path, env=env or {})  # fmt: skip
        started.append(up)
        return up.start(timeout=60) if start else up

    yield make
    for up in started:
        up.kill()


@pytest.fixture(scope="module")
def shared_up(tmp_path_factory: pytest.TempPathFactory,
              fake_server_bin: Path) -> Iterator[UpProcess]:  # fmt: skip
    """One `up` for the tests that only look at it: two slots, an API key, an argument for the
    server after ``--``."""
    tmp_path = tmp_path_factory.mktemp("shared-up")
    model = tmp_path / "fake.gguf"
    model.write_bytes(b"GGUF")
    up = UpProcess(["--server-bin", str(fake_server_bin), "--model", str(model),
                    "--parallel", "2", "--api-key", "s3cret", "--", "--threads", "1"],
                   tmp_path)  # fmt: skip
    try:
        yield up.start(timeout=60)
    finally:
        up.kill()


def chat(up: UpProcess, tokens: int = 8) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    log = stream_sse(up.url + "/v1/chat/completions", body, timeout=60)
    assert log.status == 200, log.body()
    assert log.done, log.body()
    assert len(log.events) == tokens


def test_up_serves_through_the_sidecar_and_sigterm_stops_everything(run_up: RunUp) -> None:
    up = run_up()
    assert up.url in up.text()
    assert "curl -N" in up.text()
    chat(up)
    kids = up.children()
    assert up.server_pid() in kids
    assert any("sidecar.cli.proxy" in cmdline(p) for p in kids), [cmdline(p) for p in kids]
    assert up.terminate() == 0
    assert [p for p in kids if alive(p)] == []
    assert "[up] stopped" in up.text()


def test_sigkill_of_up_takes_the_children_with_it(run_up: RunUp) -> None:
    up = run_up()
    kids = up.children()
    assert len(kids) >= 2
    assert up.process is not None
    os.kill(up.process.pid, signal.SIGKILL)
    up.process.wait(10)
    # PR_SET_PDEATHSIG: the kernel kills them; nothing reparented to init survives.
    wait_until(lambda: not any(alive(p) for p in kids), 10, "the children to die")


def test_up_restarts_a_killed_server(run_up: RunUp) -> None:
    up = run_up()
    first = up.server_pid()
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: "llama-server is back" in up.text(), 30, "the restart")
    assert "killed by SIGKILL" in up.text()
    second = up.server_pid()
    assert second != first
    up.wait_healthy()
    chat(up)
    kids = up.children()
    assert up.terminate() == 0
    assert [p for p in kids if alive(p)] == []


def test_arguments_after_double_dash_reach_the_server(shared_up: UpProcess) -> None:
    argv = cmdline(shared_up.server_pid())
    assert "--parallel 2" in argv
    assert argv.rstrip().endswith("--threads 1")
    assert "--preempt-ram 4096" in argv


def test_a_build_without_preemption_is_started_without_the_flag(run_up: RunUp) -> None:
    up = run_up(env={"FAKE_NO_PREEMPT": "1"})
    assert "has no --preempt-ram" in up.text()
    assert "--preempt-ram" not in cmdline(up.server_pid())
    assert "parking: off" in up.text()


def test_a_server_that_cannot_start_fails_fast_with_its_log(run_up: RunUp) -> None:
    up = run_up("--", "--fake-fail", start=False)
    with pytest.raises(RuntimeError) as info:
        up.start(timeout=30)
    assert up.process is not None
    assert up.process.wait(10) == 1
    text = str(info.value)
    assert "exited during start-up" in text
    assert "invalid argument: --fake-fail" in text  # the log tail is shown


def test_a_second_up_on_the_same_ports_refuses_to_start(run_up: RunUp,
                                                        shared_up: UpProcess) -> None:  # fmt: skip
    first = shared_up
    second = run_up(start=False)
    second.port, second.server_port = first.port, first.server_port
    with pytest.raises(RuntimeError) as info:
        second.start(timeout=30)
    assert "port already in use for llama-server" in str(info.value)
    assert "--server-port" in str(info.value)
    first.wait_healthy()  # the first one is unharmed


def test_api_key_is_enforced_by_the_sidecar_and_health_stays_public(shared_up: UpProcess) -> None:
    up = shared_up
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    url = up.url + "/v1/chat/completions"
    assert stream_sse(url, body, timeout=30).status == 401
    ok = stream_sse(url, body, timeout=30, headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200
    assert ok.done
    assert "Authorization: Bearer" in up.text()  # the printed curl line carries the key header

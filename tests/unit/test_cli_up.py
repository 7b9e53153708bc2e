"""`up`'s pure parts: the command lines it builds, the restart backoff, URLs."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sidecar.config import OPTIONS, Config
from sidecar.ops import supervise
from sidecar.ops.supervise import Child, UpConfig, server_argv, sidecar_argv


def cfg(**kw: object) -> UpConfig:
    base: dict[str, object] = {"server_bin": Path("/bin/llama-server"), "model": Path("/m.gguf")}
    base.update(kw)
    return UpConfig(**base)  # type: ignore[arg-type]


def opt(argv: list[str], name: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last occurrence wins


def test_server_argv_defaults() -> None:
    argv = server_argv(cfg())
    assert argv[0] == "/bin/llama-server"
    assert "--kv-unified" in argv
    assert "--metrics" in argv
    assert "--slots" in argv
    assert opt(argv, "--parallel") == "4"
    assert opt(argv, "-c") == str(4 * 4096)
    assert opt(argv, "--preempt-ram") == "4096"
    assert opt(argv, "--sse-ping-interval") == "1"
    assert opt(argv, "--host") == "127.0.0.1"
    assert opt(argv, "--port") == "8080"


def test_server_argv_extra_args_come_last_and_parking_can_be_off() -> None:
    argv = server_argv(cfg(parallel=2, ctx_size=256, server_args=("-c", "512", "-t", "1")))
    assert argv[-4:] == ["-c", "512", "-t", "1"]
    assert opt(argv, "-c") == "512"
    assert "--preempt-ram" not in server_argv(cfg(preempt_ram=0))
    assert "--preempt-ram" not in server_argv(cfg(), preempt=False)
    assert opt(server_argv(cfg(preempt_ram=-1)), "--preempt-ram") == "-1"


def test_sidecar_argv() -> None:
    sidecar = Config(listen="127.0.0.1:9000", metrics_listen="127.0.0.1:9002", api_key="k")
    argv = sidecar_argv(cfg(sidecar=sidecar, server_port=9001))
    assert opt(argv, "--upstream") == "http://127.0.0.1:9001"
    assert opt(argv, "--listen") == "127.0.0.1:9000"
    assert opt(argv, "--metrics-listen") == "127.0.0.1:9002"
    assert opt(argv, "--api-key") == "k"
    # the table's default: up and proxy drain alike
    assert opt(argv, "--drain-timeout") == "30.0"
    # every option goes to the child, so what up read wins over what the child inherits
    assert all(o.flag in argv for o in OPTIONS)


@pytest.mark.parametrize(
    ("host", "url"),
    [("127.0.0.1", "http://127.0.0.1:8081"), ("0.0.0.0", "http://127.0.0.1:8081"),
     ("::", "http://[::1]:8081"), ("::1", "http://[::1]:8081")],
)  # fmt: skip
def test_sidecar_url_connects_to_loopback_for_wildcards(host: str, url: str) -> None:
    listen = f"[{host}]:8081" if ":" in host else f"{host}:8081"
    assert cfg(sidecar=Config(listen=listen)).sidecar_url == url


def test_backoff_doubles_to_the_cap_and_resets_after_a_stable_run() -> None:
    child = Child("x", ["true"])
    child.started_at = 1000.0
    delays = [child.next_backoff(now=1000.0 + i) for i in range(8)]
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert child.next_backoff(now=1000.0 + supervise.STABLE_AFTER_S + 1) == 1


def test_busy_ports_names_the_listener_and_the_flag() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert supervise.port_in_use("127.0.0.1", taken)
        sidecar = Config(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        busy = supervise.busy_ports(cfg(server_port=taken, sidecar=sidecar))
        assert busy == [f"llama-server (127.0.0.1:{taken}; choose another with --server-port)"]
        sidecar = Config(listen=f"127.0.0.1:{taken}", metrics_listen=f"127.0.0.1:{taken}")
        busy = supervise.busy_ports(cfg(server_port=0, sidecar=sidecar))
        assert busy == [
            f"the sidecar (127.0.0.1:{taken}; choose another with --listen)",
            f"the sidecar's metrics (127.0.0.1:{taken}; choose another with --metrics-listen)",
        ]
        sidecar = Config(listen="127.0.0.1:0", metrics_listen=None)
        assert supervise.busy_ports(cfg(server_port=0, sidecar=sidecar)) == []
    assert not supervise.port_in_use("127.0.0.1", taken)

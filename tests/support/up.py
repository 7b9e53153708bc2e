"""Drive `llama-sidecar up` as a real child process, the way an operator would.

`UpProcess` starts the CLI on free ports (a :class:`~tests.support.procs.ManagedProcess`
with its output piped), waits for its "is up" banner, finds the
processes it started (through /proc), and always stops it; `descendants()` is how the
tests prove that nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.procs import (
    ManagedProcess,
    ProcessFailed,
    Service,
    free_port,
    line_seen,
    wait_until,
)

READY = "llama-sidecar is up"


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses.
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] != b"Z"


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class UpProcess(Service):
    args: Sequence[str]
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    server_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: ManagedProcess | None = None

    @property
    def server_url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def server_log(self) -> Path:
        return self.log_dir / "llama-server.log"

    def start(self, timeout: float = 180.0) -> UpProcess:
        cmd = [
            sys.executable, "-c", "from sidecar.cli import main; main()", "up",
            "--listen", f"127.0.0.1:{self.port}", "--server-port", str(self.server_port),
            "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
            "--server-log", str(self.server_log),
            *self.args,
        ]  # fmt: skip
        # A session of its own: a test can signal `up` alone, as a terminal would not.
        self.process = ManagedProcess(
            cmd, "up", {"PYTHONUNBUFFERED": "1", **self.env}, ready=line_seen(READY),
            new_session=True, poll_every=0.2,
        )  # fmt: skip
        try:
            self.process.start(timeout)
        except ProcessFailed:
            self.kill()
            text = f"`up` did not come up:\n{self.text()}\n{self.server_tail()}"
            raise RuntimeError(text) from None
        return self

    def text(self) -> str:
        return "" if self.process is None else self.process.output()

    def server_tail(self, n: int = 30) -> str:
        if not self.server_log.exists():
            return ""
        return "\n".join(self.server_log.read_text(errors="replace").splitlines()[-n:])

    def children(self) -> list[int]:
        assert self.process is not None
        return descendants(self.process.pid)

    def server_pid(self) -> int:
        for pid in self.children():
            if f"--port {self.server_port}" in cmdline(pid) and "--kv-unified" in cmdline(pid):
                return pid
        raise LookupError(f"no llama-server among the children of `up`:\n{self.text()}")

    def wait_healthy(self, timeout: float = 60.0) -> None:
        def healthy() -> bool:
            try:
                return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_until(healthy, timeout, "health through the sidecar", every=0.2)
        except AssertionError:
            raise TimeoutError(f"not healthy through the sidecar after {timeout}s:\n"
                               f"{self.text()}") from None  # fmt: skip

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM `up` itself (not its children) and wait for it to exit."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        rc = self.process.wait(timeout)
        self.process.close()
        return rc

    def kill(self) -> None:
        """Teardown of last resort: kill `up` and everything below it."""
        if self.process is None or self.process.proc is None:
            return
        pids = self.children() if self.process.alive() else []
        for pid in [self.process.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        # Grandchildren that outlived `up` would keep the pipe open; they were killed above.
        self.process.close()

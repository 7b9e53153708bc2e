"""One way to run a helper process for a test: start, wait until ready, stop, show its log.

Theory of operation: every real program a test drives (llama-server, nginx, Prometheus,
HAProxy, the sidecar CLI, `llama-sidecar up`, the hostile-load children) needs the same
five things, and :class:`ManagedProcess` is the only place they are written:

* **argv and env**: the command line, with ``env`` laid over ``os.environ``;
* **output**: to a log file (``log_path``; what a long-running server writes can be large)
  or, with ``log_path=None``, through a pipe that a thread reads into ``lines`` (so a chatty
  child never blocks on a full pipe, and a ready line can be waited for);
* **ready probe**: ``ready(process) -> bool``, polled until true (a connection refused or
  any ``OSError`` or ``httpx.HTTPError`` counts as "not yet"); a process that exits
  first raises :class:`ProcessDied`, one not ready in time :class:`NotReady`, both with the
  log tail;
* **stop**: ``stop_signal`` (SIGTERM unless the program wants another: nginx drains on
  SIGQUIT), wait, then SIGKILL; idempotent, and it closes the log and the pipe;
* **log tail on failure**: :meth:`tail` (plus any ``extra_logs`` the program writes itself).

:func:`free_port` and :func:`wait_until` are the suite's only copies of those helpers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    cond: Callable[[], T], timeout: float = 10.0, what: str = "the condition",
    every: float = 0.05,
) -> T:  # fmt: skip
    """Poll ``cond`` until it returns something truthy, and return that.

    AssertionError naming ``what`` (and the last value) after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        last = cond()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what} (last value: {last!r})")
        time.sleep(every)


def file_tail(path: Path, chars: int = 4000) -> str:
    """The last ``chars`` characters of a log file ("" if it does not exist yet)."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class ProcessFailed(RuntimeError):
    """A managed process did not come up; the message carries the end of its log."""


class ProcessDied(ProcessFailed):
    """It exited before it was ready."""


class NotReady(ProcessFailed, TimeoutError):
    """It was still running but not ready when the start timeout ran out (it was stopped)."""


def http_ok(url: str, timeout: float = 2.0) -> Callable[[ManagedProcess], bool]:
    """A ready probe: GET ``url`` answers 200."""
    return lambda _: httpx.get(url, timeout=timeout).status_code == 200


def http_answers(url: str, timeout: float = 2.0) -> Callable[[ManagedProcess], bool]:
    """A ready probe: GET ``url`` gets any HTTP answer at all."""

    def probe(_: ManagedProcess) -> bool:
        httpx.get(url, timeout=timeout)
        return True

    return probe


def tcp_listening(port: int, host: str = "127.0.0.1") -> Callable[[ManagedProcess], bool]:
    """A ready probe: a TCP connection to ``host:port`` is accepted."""

    def probe(_: ManagedProcess) -> bool:
        socket.create_connection((host, port), timeout=1.0).close()
        return True

    return probe


def line_seen(marker: str) -> Callable[[ManagedProcess], bool]:
    """A ready probe for piped output: a line containing ``marker`` arrived."""
    return lambda p: p.find_line(marker) is not None


@dataclass(eq=False)
class ManagedProcess:
    argv: Sequence[str]
    name: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    ready: Callable[[ManagedProcess], bool] | None = None
    stop_signal: int = signal.SIGTERM
    stop_timeout: float = 10.0
    cwd: Path | None = None
    new_session: bool = False
    stdin: bool = False  # a pipe the test can write to or close (the children's stop signal)
    merge_stderr: bool = True  # False: stderr stays the test's (stdout is a JSON answer)
    nice: int = 0
    extra_logs: Sequence[Path] = ()
    echo_command: bool = False  # first line of the log file: "$ argv"
    poll_every: float = 0.05
    proc: subprocess.Popen[Any] | None = None
    lines: list[str] = field(default_factory=list)
    max_lines: int = 10_000

    def __post_init__(self) -> None:
        self.name = self.name or Path(self.argv[0]).name
        self._log: IO[bytes] | None = None
        self._pump: threading.Thread | None = None
        self._lines_lock = threading.Lock()

    # ---- life cycle -------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> ManagedProcess:
        """Start the process and wait until ``ready`` (if any) says so."""
        assert self.proc is None, f"{self.name} already started"
        env = {**os.environ, **self.env}
        out: Any
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = out = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            if self.echo_command:
                out.write(("$ " + " ".join(map(str, self.argv)) + "\n").encode())
                out.flush()
        else:
            out = subprocess.PIPE
        self.proc = subprocess.Popen(
            [str(a) for a in self.argv], env=env, cwd=self.cwd, stdout=out,
            stderr=subprocess.STDOUT if self.merge_stderr else None,
            stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL,
            text=self.log_path is None, start_new_session=self.new_session,
        )  # fmt: skip
        if self.nice:
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, self.nice)
        if self.log_path is None:
            self._pump = threading.Thread(target=self._read_output, daemon=True)
            self._pump.start()
        if self.ready is not None:
            self._wait_ready(self.ready, timeout)
        return self

    def _wait_ready(self, ready: Callable[[ManagedProcess], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                self._join_pump()
                raise ProcessDied(
                    f"{self.name} exited with {self.returncode} before it was ready:\n"
                    + self.failure_text())
            try:
                if ready(self):
                    return
            except (OSError, httpx.HTTPError):
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise NotReady(f"{self.name} not ready after {timeout}s:\n" + self.failure_text())
            time.sleep(self.poll_every)

    def _read_output(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lines_lock:
                self.lines.append(line)
                if len(self.lines) > self.max_lines:
                    del self.lines[: self.max_lines // 2]

    def _join_pump(self, timeout: float = 10.0) -> None:
        if self._pump is not None:
            self._pump.join(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def send_signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float | None = None) -> int | None:
        """``stop_signal``, wait up to ``timeout`` (default ``stop_timeout``), then SIGKILL.

        Returns the exit code (None if never started). Safe to call more than once.
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL now (teardown of last resort), then close what is open."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)
        self.close()

    def close(self) -> None:
        """Close the log file, the stdin pipe, and (once read to its end) the output pipe."""
        if self._log is not None:
            self._log.close()
        if self.proc is None:
            return
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self._join_pump()
        if self.proc.stdout is not None and (self._pump is None or not self._pump.is_alive()):
            self.proc.stdout.close()

    # ---- output -----------------------------------------------------------------------

    def output(self) -> str:
        """Everything it wrote so far (the log file, or the piped lines)."""
        if self.log_path is not None:
            return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        with self._lines_lock:
            return "".join(self.lines)

    def find_line(self, marker: str) -> str | None:
        """The first line of piped output containing ``marker``."""
        with self._lines_lock:
            return next((ln for ln in self.lines if marker in ln), None)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def failure_text(self, n: int = 40) -> str:
        """The log tail, and the tail of every ``extra_logs`` file that exists."""
        parts = [self.tail(n)]
        for p in self.extra_logs:
            if p.exists():
                text = "\n".join(p.read_text(errors="replace").splitlines()[-n:])
                parts.append(f"--- {p.name} ---\n{text}")
        return "\n".join(parts)


class Service:
    """Mixin for a program a test runs on a loopback port around a :class:`ManagedProcess`.

    The dataclass that uses it declares ``port`` and ``process`` (None until started).
    """

    port: int
    process: ManagedProcess | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def stop(self) -> int | None:
        """Stop the process (its ``stop_signal``, then SIGKILL); its exit code."""
        return None if self.process is None else self.process.stop()

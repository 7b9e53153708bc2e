"""Run the patched llama-server and the sidecar as one supervised pair (`llama-sidecar up`).

Theory of operation
-------------------
Two children, started in order and stopped in reverse:

1. llama-server, on loopback, its output appended to a log file (it is verbose; the
   console is for the sidecar's access log and for our own status lines).  Ready when
   ``GET /health`` answers 200 (503 while the model loads).
2. the sidecar (``llama-sidecar proxy``) in front of it, output inherited.  Ready when
   ``GET /health`` *through the sidecar* answers 200, which proves both hops at once.

Each child is its own session and process group (``start_new_session``), so a Ctrl-C at
the terminal reaches only this supervisor, which then stops the children in order: the
sidecar first (it drains running streams, which still need llama-server), then
llama-server.  Each stop is SIGTERM to the child's process group, a bounded wait, then
SIGKILL.  Should the supervisor itself be killed outright, ``PR_SET_PDEATHSIG`` (set in
the child between fork and exec, Linux only) makes the kernel SIGKILL the children, so no
path leaves an orphan holding the GPU or a port.  Children are forked from the main
thread: the death signal follows the *thread* that forked, not the process.

A child that dies on its own is restarted after a backoff (1 s doubling to 30 s, back to
1 s once a child has stayed up for a minute).  While llama-server is down the sidecar
keeps answering (502 with a JSON error) so clients and Prometheus see what happened.

Everything here is synchronous: two processes polled every 100 ms need no event loop,
and a signal handler that only sets a flag cannot race with anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import httpx

from sidecar.config import Config, config_argv

__all__ = [
    "Child",
    "StartupError",
    "Stopping",
    "Supervisor",
    "UpConfig",
    "server_argv",
    "server_supports",
    "sidecar_argv",
]

POLL_S = 0.1
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
PR_SET_PDEATHSIG = 1

Echo = Callable[[str], None]


class StartupError(RuntimeError):
    """A child did not become healthy; the message says what to look at."""


class Stopping(Exception):
    """Raised inside waits once a stop was requested."""


@dataclass(frozen=True)
class UpConfig:
    server_bin: Path
    model: Path
    # the sidecar's options (its upstream is llama-server below, whatever this one says)
    sidecar: Config = field(default_factory=Config)
    server_host: str = "127.0.0.1"
    server_port: int = 8080
    parallel: int = 4
    ctx_size: int | None = None  # None: 4096 per slot
    preempt_ram: int = 4096  # MiB; 0 = off, -1 = unlimited
    ping_interval: int = 1
    startup_timeout: float = 300.0
    server_log: Path | None = None
    server_args: tuple[str, ...] = ()
    sidecar_args: tuple[str, ...] = ()
    server_env: tuple[tuple[str, str], ...] = ()

    @property
    def host(self) -> str:
        return self.sidecar.listen_addr[0]

    @property
    def port(self) -> int:
        return self.sidecar.listen_addr[1]

    @property
    def server_url(self) -> str:
        return f"http://{_url_host(self.server_host)}:{self.server_port}"

    @property
    def sidecar_url(self) -> str:
        return f"http://{_url_host(_connect_host(self.host))}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        addr = self.sidecar.metrics_addr
        if addr is None:
            return None
        return f"http://{_url_host(_connect_host(addr[0]))}:{addr[1]}/metrics"

    @property
    def n_ctx(self) -> int:
        return self.ctx_size if self.ctx_size is not None else 4096 * self.parallel


def _connect_host(host: str) -> str:
    """Where to connect for a listener bound to `host` (a wildcard means loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def server_supports(binary: Path, flag: str) -> bool:
    """Whether `binary --help` lists `flag` (the preemption patch adds --preempt-ram)."""
    try:
        out = subprocess.run(
            [str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = out.stdout + out.stderr
    return any(tok.strip(",") == flag for tok in text.split())


def server_argv(cfg: UpConfig, *, preempt: bool = True) -> list[str]:
    """llama-server's command line; the user's extra arguments come last and so win."""
    argv = [
        str(cfg.server_bin),
        "-m", str(cfg.model),
        "--host", cfg.server_host,
        "--port", str(cfg.server_port),
        "--kv-unified",
        "--parallel", str(cfg.parallel),
        "-c", str(cfg.n_ctx),
        "--metrics",
        "--slots",
        "--sse-ping-interval", str(cfg.ping_interval),
    ]  # fmt: skip
    if preempt and cfg.preempt_ram != 0:
        argv += ["--preempt-ram", str(cfg.preempt_ram)]
    return argv + list(cfg.server_args)


# `python -c` rather than the console script: works whether or not the venv's bin/ is on PATH.
_SIDECAR_MAIN = (
    "import sys; sys.argv[0] = 'llama-sidecar proxy'; from sidecar.cli.proxy import main; main()"
)


def sidecar_argv(cfg: UpConfig) -> list[str]:
    """The sidecar's command line: every option of ``cfg.sidecar`` as a flag.

    ``up`` read them from its flags and the ``LLAMA_SIDECAR_*`` variables already
    (the child inherits the variables, and the flags beat them); the upstream is
    ``up``'s llama-server.  ``sidecar_args`` come last and so win.
    """
    config = cfg.sidecar.replace(upstream=cfg.server_url)
    return [sys.executable, "-c", _SIDECAR_MAIN, *config_argv(config), *cfg.sidecar_args]


def port_in_use(host: str, port: int) -> bool:
    """Whether binding `host:port` fails now (something listens there already)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def busy_ports(cfg: UpConfig) -> list[str]:
    """The listeners of `cfg` whose port is taken, as "what (host:port)" strings."""
    wanted = [
        ("llama-server", cfg.server_host, cfg.server_port, "--server-port"),
        ("the sidecar", cfg.host, cfg.port, "--listen"),
    ]
    if (metrics := cfg.sidecar.metrics_addr) is not None:
        wanted.append(("the sidecar's metrics", *metrics, "--metrics-listen"))
    return [
        f"{what} ({_url_host(host)}:{port}; choose another with {flag})"
        for what, host, port, flag in wanted
        if port and port_in_use(host, port)
    ]


def _libc_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    prctl: Callable[..., int] = libc.prctl
    return prctl


_PRCTL = _libc_prctl()


def _child_setup(parent_pid: int) -> Callable[[], None]:
    """Runs in the child between fork and exec: die with the supervisor."""

    def setup() -> None:
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


@dataclass
class Child:
    """One supervised process: its own process group, optional log file, restart bookkeeping."""

    name: str
    argv: Sequence[str]
    env: dict[str, str] | None = None
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    starts: int = 0
    backoff: float = BACKOFF_START_S
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        stdout: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            if self._log is None:
                self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._log.write(f"\n==== {stamp} $ {shlex.join(self.argv)}\n".encode())
            self._log.flush()
            stdout = self._log
        self.proc = subprocess.Popen(
            list(self.argv),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            env=self.env,
            start_new_session=True,
            preexec_fn=_child_setup(os.getpid()),
        )
        self.started_at = time.monotonic()
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_status(self) -> str:
        rc = self.proc.returncode if self.proc is not None else None
        if rc is None:
            return "running"
        if rc < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-rc).name}"
        return f"exit status {rc}"

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - the group was reused by someone else
            self.proc.send_signal(sig)

    def stop(self, timeout: float) -> None:
        """SIGTERM the group, wait up to `timeout`, then SIGKILL. Always reaps."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        # Whatever else is left in the group (the leader may be gone already).
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)

    def log_tail(self, n: int = 25) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def next_backoff(self, now: float | None = None) -> float:
        """The delay before restarting a child that just died; grows while it keeps dying."""
        now = time.monotonic() if now is None else now
        if now - self.started_at >= STABLE_AFTER_S:
            self.backoff = BACKOFF_START_S
        delay = self.backoff
        self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)
        return delay


class Supervisor:
    def __init__(self, cfg: UpConfig, *, echo: Echo | None = None, preempt: bool = True) -> None:
        self.cfg = cfg
        self.echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.stop_requested = 0  # number of stop signals received
        env = {**os.environ, **dict(cfg.server_env)}
        self.server = Child(
            "llama-server", server_argv(cfg, preempt=preempt), env=env,
            log_path=cfg.server_log,
        )  # fmt: skip
        self.sidecar = Child("sidecar", sidecar_argv(cfg))
        self.restarts = {"llama-server": 0, "sidecar": 0}

    # ---- signals ---------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested += 1
        if self.stop_requested > 1:
            # Second Ctrl-C: do not wait for the drain.
            self.sidecar.signal_group(signal.SIGKILL)
            self.server.signal_group(signal.SIGKILL)

    def _check(self) -> None:
        if self.stop_requested:
            raise Stopping

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            self._check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(POLL_S, left))

    # ---- readiness -------------------------------------------------------------------

    def _wait_healthy(self, child: Child, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        with httpx.Client(timeout=httpx.Timeout(2.0), trust_env=False) as client:
            while True:
                self._check()
                if not child.alive():
                    raise StartupError(
                        f"{child.name} exited during start-up ({child.exit_status()})"
                    )
                try:
                    r = client.get(url)
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}"
                except httpx.TransportError as e:
                    last = type(e).__name__
                if time.monotonic() >= deadline:
                    raise StartupError(
                        f"{child.name} not healthy after {timeout:.0f}s ({url}: {last})"
                    )
                self._sleep(0.2)

    def _start_server(self) -> None:
        self.server.start()
        self._wait_healthy(self.server, self.cfg.server_url + "/health", self.cfg.startup_timeout)

    def _start_sidecar(self) -> None:
        self.sidecar.start()
        self._wait_healthy(self.sidecar, self.cfg.sidecar_url + "/health", 60.0)

    # ---- the loop ----------------------------------------------------------------------

    def run(self, on_ready: Callable[[], None] | None = None) -> int:
        """Start both, supervise until a signal; 0 on a clean stop, 1 if start-up failed."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                # Otherwise an old llama-server on the port would answer our health check.
                busy = busy_ports(self.cfg)
                if busy:
                    raise StartupError(
                        "port already in use for "
                        + ", ".join(busy)
                        + ". Is another `llama-sidecar up` or llama-server running?"
                    )
                self.echo(f"[up] starting llama-server on {self.cfg.server_url}")
                self._start_server()
                self.echo(f"[up] starting the sidecar on {self.cfg.sidecar_url}")
                self._start_sidecar()
            except StartupError as e:
                self.echo(f"[up] error: {e}")
                if self.server.proc is not None:
                    self._explain(self.server if not self.server.alive() else self.sidecar)
                return 1
            if on_ready is not None:
                on_ready()
            while True:
                self._sleep(POLL_S)
                for child, restart in (
                    (self.server, self._start_server),
                    (self.sidecar, self._start_sidecar),
                ):
                    if not child.alive():
                        self._restart(child, restart)
        except Stopping:
            return 0
        finally:
            self.shutdown()
            for s, h in old.items():
                signal.signal(s, h)

    def _restart(self, child: Child, start: Callable[[], None]) -> None:
        while True:
            delay = child.next_backoff()
            self.restarts[child.name] += 1
            self.echo(
                f"[up] {child.name} (pid {child.pid}) died: {child.exit_status()}; "
                f"restarting in {delay:.0f}s (restart #{self.restarts[child.name]})"
            )
            if child is self.server:
                tail = child.log_tail(10)
                if tail:
                    self.echo(f"[up] last lines of {child.log_path}:\n{tail}")
            self._sleep(delay)
            try:
                start()
            except StartupError as e:
                self.echo(f"[up] {e}")
                child.kill()
                continue
            self.echo(f"[up] {child.name} is back (pid {child.pid})")
            return

    def _explain(self, child: Child) -> None:
        tail = child.log_tail()
        if tail:
            self.echo(f"[up] last lines of {child.log_path}:\n{tail}")
        if child is self.server:
            self.echo(
                "[up] what to do: read the log above; a port in use needs --server-port, "
                "an unknown option came from the arguments after `--`."
            )

    def shutdown(self) -> None:
        """Sidecar first (it drains streams that still need llama-server), then the server."""
        if self.sidecar.proc is not None and self.sidecar.alive():
            self.echo("[up] stopping the sidecar")
        self.sidecar.stop(self.cfg.sidecar.drain_timeout + 5.0)
        if self.server.proc is not None and self.server.alive():
            self.echo("[up] stopping llama-server")
        self.server.stop(15.0)
        self.server.close()
        self.sidecar.close()

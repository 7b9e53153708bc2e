"""Run the sidecar for a test: in this process on a thread, or as the `proxy` command.

* :func:`ephemeral_config`: a :class:`~sidecar.config.Config` with both listeners on free
  loopback ports (port 0) and readiness polling off unless asked for.
* :func:`run_in_thread`: a :class:`~sidecar.proxy.server.Sidecar` on its own event loop in a
  background thread (for synchronous tests and tools); yields it once bound.
* :func:`start_subprocess`: the ``proxy`` command in a child Python with every option of
  the config as a flag (:func:`~sidecar.config.config_argv`), a
  :class:`~tests.support.procs.ManagedProcess` whose ready probe is the CLI's
  "listening on URL metrics URL" line; returns a :class:`SidecarProcess`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from anyio.from_thread import start_blocking_portal
from prometheus_client import CollectorRegistry

from sidecar.config import Config, config_argv
from sidecar.proxy.server import Sidecar, _use_uvloop
from tests.support.procs import ManagedProcess

READY_RE = re.compile(r"listening on (http://\S+) metrics (\S+)")
_PROXY_MAIN = "from sidecar.cli.proxy import main; main()"


def ephemeral_config(upstream: str, **overrides: object) -> Config:
    """A config whose listeners bind free loopback ports (port 0)."""
    values: dict[str, object] = {
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "upstream": upstream,
        # no readiness polling unless a test asks for it: it would add requests upstream
        "ready_poll": 0.0,
    }
    values.update(overrides)
    return Config(**values)  # type: ignore[arg-type]


@contextmanager
def run_in_thread(config: Config, registry: CollectorRegistry | None = None) -> Iterator[Sidecar]:
    """Run a sidecar on an event loop in a background thread; yield it once bound."""
    options = {"use_uvloop": True} if _use_uvloop(config) else {}
    with start_blocking_portal("asyncio", options) as portal:
        sidecar = Sidecar(config, registry)
        future, _ = portal.start_task(sidecar.run)
        try:
            yield sidecar
        finally:
            portal.call(sidecar.stop)
            future.result(timeout=10)


@dataclass
class SidecarProcess:
    """The ``proxy`` command in a child process, started and listening."""

    process: ManagedProcess
    url: str
    metrics_url: str | None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def lines(self) -> list[str]:
        """Its output so far (the access log included), line by line."""
        return self.process.lines

    def alive(self) -> bool:
        return self.process.alive()

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful drain), wait (SIGKILL after ``timeout``), the exit code."""
        code = self.process.stop(timeout)
        assert code is not None
        return code


def start_subprocess(
    config: Config,
    env: Mapping[str, str] | None = None,
    timeout: float = 20.0,
    names: Iterable[str] | None = None,
) -> SidecarProcess:
    """Start the sidecar CLI in a child process and wait until it listens.

    Every option of ``config`` is a flag, or only ``names`` (an older checkout's
    sidecar knows fewer; the rest then comes from ``env`` or its defaults).
    """
    process = ManagedProcess(
        [sys.executable, "-c", _PROXY_MAIN, *config_argv(config, names)], "sidecar",
        {**(env or {}), "PYTHONUNBUFFERED": "1"}, ready=lambda p: _listening(p) is not None,
    )  # fmt: skip
    m = _listening(process.start(timeout))
    assert m is not None
    metrics = None if m.group(2) == "None" else m.group(2)
    return SidecarProcess(process, m.group(1), metrics)


def _listening(process: ManagedProcess) -> re.Match[str] | None:
    return READY_RE.search(process.output())

"""Run a built llama-server for a test and talk to it.

`LlamaServer` starts the binary on a free loopback port with the given flags and
environment (a :class:`~tests.support.procs.ManagedProcess`: log in a file the test can
read, ready when `/health` answers 200, always stopped with SIGTERM then SIGKILL). Its
`stream` records SSE lines with arrival times (:mod:`tests.support.sse_client`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import ManagedProcess, ProcessDied, Service, free_port, http_ok
from tests.support.sse_client import StreamLog, stream_sse

# The patched server's test knobs (environment variables that force parks and failures).
TEST_KNOB_PREFIX = "LLAMA_SERVER_PREEMPT_"

# llama-server exited while starting (a rejected flag, a bad model): the log tail says why.
ServerDied = ProcessDied


@dataclass
class LlamaServer(Service):
    binary: Path
    model: Path
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = 0
    process: ManagedProcess | None = None
    # --preempt-test-knobs: the patched server reads the LLAMA_SERVER_PREEMPT_* test knobs only
    # with it. None: on when `env` names one of them.
    test_knobs: bool | None = None

    def start(self, timeout: float = 120.0) -> LlamaServer:
        self.port = self.port or free_port()
        assert self.log_path is not None
        # LLAMA_SERVER_EXTRA_ARGS is appended to every command line, e.g. "-ngl 99" to run
        # the server suite and the benchmarks on a GPU build.
        extra = shlex.split(os.environ.get("LLAMA_SERVER_EXTRA_ARGS", ""))
        knobs = self.test_knobs
        if knobs is None:
            knobs = any(k.startswith(TEST_KNOB_PREFIX) for k in self.env)
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1",
               "--port", str(self.port), "--no-webui", *self.args,
               *(["--preempt-test-knobs"] if knobs else []), *extra]  # fmt: skip
        self.process = ManagedProcess(
            cmd, "llama-server", self.env, self.log_path, ready=http_ok(self.url + "/health", 1.0),
            echo_command=True,
        )  # fmt: skip
        self.process.start(timeout)
        return self

    def log_text(self) -> str:
        assert self.log_path is not None
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    # ---- client helpers ------------------------------------------------------------------

    def post(self, path: str, body: Mapping[str, Any], timeout: float = 120.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def get_json(self, path: str) -> Any:
        r = httpx.get(self.url + path, timeout=30.0)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[str, float]:
        """`/metrics` (needs --metrics) as {sample name without prefix: value}."""
        r = httpx.get(self.url + "/metrics", timeout=30.0)
        r.raise_for_status()
        return parse_metrics(r.text)

    def stream(self, path: str, body: Mapping[str, Any], timeout: float = 300.0) -> StreamLog:
        return stream_sse(self.url + path, body, timeout=timeout)


def parse_metrics(text: str, prefix: str = "llamacpp:") -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.removeprefix(prefix)
            if s.labels:
                name += "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            out[name] = s.value
    return out


"""Run a built llama-server for a test and talk to it.

`LlamaServer` starts the binary on a free loopback port with the given flags and
environment, waits until `/health` answers 200, keeps the process log in a file the test
can read, and always stops the process (SIGTERM, then SIGKILL). The client helpers record
each SSE line with its arrival time, because the notices and pings under test are comment
lines that SSE client libraries hide.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sidecar.probe import split_lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerDied(RuntimeError):
    pass


@dataclass
class LlamaServer:
    binary: Path
    model: Path
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> LlamaServer:
        self.port = self.port or free_port()
        assert self.log_path is not None
        # LLAMA_SERVER_EXTRA_ARGS is appended to every command line, e.g. "-ngl 99" to run
        # the server suite and the benchmarks on a GPU build.
        extra = shlex.split(os.environ.get("LLAMA_SERVER_EXTRA_ARGS", ""))
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1",
               "--port", str(self.port), "--no-webui", *self.args, *extra]
        env = {**os.environ, **self.env}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._log.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerDied(
                    f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"llama-server not healthy after {timeout}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

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


@dataclass
class StreamLog:
    """Every line of an SSE response with its arrival time (seconds since the request)."""

    status: int
    lines: list[tuple[float, str]]
    t_start: float
    t_headers: float = 0.0
    error: str | None = None

    @property
    def comments(self) -> list[tuple[float, str]]:
        return [(t, ln) for t, ln in self.lines if ln.startswith(":")]

    @property
    def events(self) -> list[Any]:
        """Decoded `data:` payloads, `[DONE]` excluded."""
        out = []
        for _, ln in self.lines:
            if ln.startswith("data: ") and ln != "data: [DONE]":
                out.append(json.loads(ln[6:]))
        return out

    @property
    def done(self) -> bool:
        return any(ln == "data: [DONE]" for _, ln in self.lines)

    def body(self) -> str:
        return "\n".join(ln for _, ln in self.lines)

    def content(self) -> str:
        """Concatenated generated text of a /completion or chat stream."""
        parts = []
        for ev in self.events:
            if "content" in ev and isinstance(ev["content"], str):
                parts.append(ev["content"])
            for ch in ev.get("choices", []) or []:
                delta = ch.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    parts.append(delta["content"])
                elif isinstance(ch.get("text"), str):
                    parts.append(ch["text"])
        return "".join(parts)

    def tokens(self) -> list[int]:
        out: list[int] = []
        for ev in self.events:
            out.extend(ev.get("tokens", []) or [])
        return out

    def final(self) -> Any:
        """The last data event (the one carrying timings/usage)."""
        ev = self.events
        return ev[-1] if ev else None


def stream_sse(url: str, body: Mapping[str, Any], timeout: float = 300.0,
               headers: Mapping[str, str] | None = None) -> StreamLog:
    """POST `body` and read the response line by line, timestamping each line on arrival."""
    t0 = time.monotonic()
    lines: list[tuple[float, str]] = []
    t = httpx.Timeout(timeout, connect=10.0)
    with httpx.stream("POST", url, json=body, timeout=t, headers=headers) as r:
        t_headers = time.monotonic() - t0
        buf = b""
        try:
            for chunk in r.iter_raw():
                now = time.monotonic() - t0
                got, buf = split_lines(buf + chunk)
                lines.extend((now, ln.decode("utf-8", "replace")) for ln in got)
        except httpx.HTTPError as e:
            return StreamLog(r.status_code, [x for x in lines if x[1]], t0, t_headers, repr(e))
        if buf:
            lines.append((time.monotonic() - t0, buf.decode("utf-8", "replace")))
    return StreamLog(r.status_code, [x for x in lines if x[1]], t0, t_headers)


@contextmanager
def running(server: LlamaServer) -> Iterator[LlamaServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()

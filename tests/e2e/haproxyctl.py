"""Run a real HAProxy with docs/deploy/haproxy.cfg (ports substituted) for a test."""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from tests.support.llama import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "docs" / "deploy" / "haproxy.cfg"
HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if Path(p).exists()), None
)


def pairs_config(pairs: list[tuple[int, int]], port: int, stats_port: int, inter: str) -> str:
    """docs/deploy/haproxy.cfg for these (proxy port, metrics port) pairs and check interval."""
    text = CONFIG.read_text()
    checked = "".join(
        f"    server pair{i} 127.0.0.1:{p} check port {m}\n" for i, (p, m) in enumerate(pairs, 1)
    )
    backups = "".join(
        f"    server any{i} 127.0.0.1:{p} backup\n" for i, (p, _) in enumerate(pairs, 1)
    )
    text, n_srv = re.subn(r"(    server pair\d .*\n)+", checked, text)
    text, n_backup = re.subn(r"(    server any\d .*\n)+", backups, text)
    text, n_bind = re.subn(r"bind 127\.0\.0\.1:8000", f"bind 127.0.0.1:{port}", text)
    text, n_stats = re.subn(r"bind 127\.0\.0\.1:8404", f"bind 127.0.0.1:{stats_port}", text)
    text, n_inter = re.subn(r"inter 1s", f"inter {inter}", text)
    counts = (n_srv, n_backup, n_bind, n_stats, n_inter)
    assert counts == (1, 1, 1, 1, 1), f"docs/deploy/haproxy.cfg changed shape: {counts}"
    return text


@dataclass
class HAProxy:
    tmp: Path
    pairs: list[tuple[int, int]]
    inter: str = "200ms"
    port: int = field(default_factory=free_port)
    stats_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HAProxy:
        assert HAPROXY is not None
        cfg = self.tmp / "haproxy.cfg"
        cfg.write_text(pairs_config(self.pairs, self.port, self.stats_port, self.inter))
        self._log = log = (self.tmp / "haproxy.log").open("wb")
        # -db: stay in the foreground, one process, so terminate() stops it
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.status()
                return self
            except httpx.HTTPError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        raise RuntimeError(f"haproxy did not start:\n{(self.tmp / 'haproxy.log').read_text()}")

    def status(self) -> dict[str, str]:
        """{server name: UP / DOWN / ...} from the stats page's CSV."""
        r = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5)
        r.raise_for_status()
        rows = csv.DictReader(io.StringIO(r.text.lstrip("# ")))
        return {row["svname"]: row["status"] for row in rows if row["pxname"] == "pairs"}

    def wait_status(self, server: str, want: str, timeout: float = 20.0) -> float:
        """Wait until HAProxy reports `server` as `want`; the monotonic time it did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status().get(server, "").startswith(want):
                return time.monotonic()
            time.sleep(0.05)
        raise AssertionError(f"haproxy never marked {server} {want}: {self.status()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()

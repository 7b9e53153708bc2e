"""Run a real HAProxy with docs/deploy/haproxy.cfg (ports substituted) for a test."""

from __future__ import annotations

import csv
import io
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.procs import ManagedProcess, Service, free_port, wait_until

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
class HAProxy(Service):
    tmp: Path
    pairs: list[tuple[int, int]]
    inter: str = "200ms"
    port: int = field(default_factory=free_port)
    stats_port: int = field(default_factory=free_port)
    process: ManagedProcess | None = None

    def start(self, timeout: float = 10.0) -> HAProxy:
        assert HAPROXY is not None
        cfg = self.tmp / "haproxy.cfg"
        cfg.write_text(pairs_config(self.pairs, self.port, self.stats_port, self.inter))
        # -db: stay in the foreground, one process, so SIGTERM stops it
        self.process = ManagedProcess(
            [HAPROXY, "-db", "-f", str(cfg)], "haproxy", log_path=self.tmp / "haproxy.log",
            ready=self._stats_answer,
        )  # fmt: skip
        self.process.start(timeout)
        return self

    def _stats_answer(self, _: ManagedProcess) -> bool:
        self.status()  # raises until the stats listener answers
        return True

    def status(self) -> dict[str, str]:
        """{server name: UP / DOWN / ...} from the stats page's CSV."""
        r = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5)
        r.raise_for_status()
        rows = csv.DictReader(io.StringIO(r.text.lstrip("# ")))
        return {row["svname"]: row["status"] for row in rows if row["pxname"] == "pairs"}

    def wait_status(self, server: str, want: str, timeout: float = 20.0) -> float:
        """Wait until HAProxy reports `server` as `want`; the monotonic time it did."""
        wait_until(lambda: self.status().get(server, "").startswith(want), timeout,
                   f"haproxy to mark {server} {want}")  # fmt: skip
        return time.monotonic()

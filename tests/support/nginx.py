"""Run a real nginx for a test: docs/nginx.conf (ports and timeout substituted) or any config."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import ManagedProcess, Service, file_tail, free_port, http_answers

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "docs" / "nginx.conf"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
)


def site_config(upstream_port: int, listen_port: int, read_timeout: str | None = None) -> str:
    """docs/nginx.conf with the ports (and optionally proxy_read_timeout) replaced."""
    text = SITE.read_text()
    text, n_up = re.subn(r"server 127\.0\.0\.1:8081\b", f"server 127.0.0.1:{upstream_port}", text)
    text, n_listen = re.subn(r"listen 8000;", f"listen 127.0.0.1:{listen_port};", text)
    assert n_up == 1, "docs/nginx.conf no longer has the expected lines"
    assert n_listen == 1, "docs/nginx.conf no longer has the expected lines"
    if read_timeout is not None:
        text, n = re.subn(r"proxy_read_timeout \S+;", f"proxy_read_timeout {read_timeout};", text)
        assert n == 1
    return text


@dataclass
class Nginx(Service):
    """nginx in the foreground with ``site`` included in its ``http`` block.

    ``conf``, when given, is the whole nginx.conf instead (``{tmp}`` is the prefix); the
    temp paths below ``tmp`` are made either way.
    """

    tmp: Path
    site: str
    port: int = 0
    conf: str | None = None
    process: ManagedProcess | None = None

    def start(self, timeout: float = 20.0) -> Nginx:
        assert NGINX is not None
        t = self.tmp
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (t / sub).mkdir(parents=True, exist_ok=True)
        (t / "site.conf").write_text(self.site)
        (t / "nginx.conf").write_text(self.conf or (
            f"daemon off;\nworker_processes 1;\npid {t}/nginx.pid;\n"
            f"error_log {t}/error.log info;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n  access_log {t}/access.log;\n"
            f"  client_body_temp_path {t}/body;\n  proxy_temp_path {t}/proxy;\n"
            f"  fastcgi_temp_path {t}/fastcgi;\n  uwsgi_temp_path {t}/uwsgi;\n"
            f"  scgi_temp_path {t}/scgi;\n  include {t}/site.conf;\n}}\n"
        ))  # fmt: skip
        argv = [NGINX, "-p", str(t), "-c", str(t / "nginx.conf"), "-e", str(t / "error.log")]
        check = subprocess.run([*argv, "-t"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        # SIGQUIT: a graceful stop; the workers exit with the master.
        self.process = ManagedProcess(
            argv, "nginx", log_path=t / "nginx.out", ready=http_answers(self.url + "/", 1.0),
            stop_signal=signal.SIGQUIT, extra_logs=[t / "error.log"], poll_every=0.1,
        )  # fmt: skip
        self.process.start(timeout)
        return self

    def error_log(self) -> str:
        return file_tail(self.tmp / "error.log")


def start_nginx(tmp: Path, upstream_port: int, read_timeout: str | None = None) -> Nginx:
    port = free_port()
    return Nginx(tmp, site_config(upstream_port, port, read_timeout), port).start()


PAIRS = REPO / "docs" / "deploy" / "nginx-pairs.conf"


def pairs_config(sidecar_ports: list[int], listen_port: int) -> str:
    """docs/deploy/nginx-pairs.conf with its example servers replaced by local sidecars."""
    text = PAIRS.read_text()
    servers = re.findall(r"^ *server 10\.0\.0\.\d+:8081 .*;\n", text, flags=re.M)
    assert len(servers) == 3, "docs/deploy/nginx-pairs.conf no longer has the example lines"
    local = "".join(f"    server 127.0.0.1:{p} max_fails=3 fail_timeout=10s;\n"
                    for p in sidecar_ports)  # fmt: skip
    text = text.replace("".join(servers), local)
    text, n = re.subn(r"listen 8000;", f"listen 127.0.0.1:{listen_port};", text)
    assert n == 1
    return text

"""Run a real nginx with docs/nginx.conf (ports and timeout substituted) for a test."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.llama import free_port

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
    assert n_up == 1 and n_listen == 1, "docs/nginx.conf no longer has the expected lines"
    if read_timeout is not None:
        text, n = re.subn(r"proxy_read_timeout \S+;", f"proxy_read_timeout {read_timeout};", text)
        assert n == 1
    return text


@dataclass
class Nginx:
    tmp: Path
    site: str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Nginx:
        assert NGINX is not None
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.tmp / sub).mkdir(parents=True, exist_ok=True)
        (self.tmp / "site.conf").write_text(self.site)
        t = self.tmp
        (t / "nginx.conf").write_text(
            f"daemon off;\nworker_processes 1;\npid {t}/nginx.pid;\n"
            f"error_log {t}/error.log info;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n  access_log {t}/access.log;\n"
            f"  client_body_temp_path {t}/body;\n  proxy_temp_path {t}/proxy;\n"
            f"  fastcgi_temp_path {t}/fastcgi;\n  uwsgi_temp_path {t}/uwsgi;\n"
            f"  scgi_temp_path {t}/scgi;\n  include {t}/site.conf;\n}}\n"
        )
        check = subprocess.run([NGINX, "-t", "-p", str(t), "-c", str(t / "nginx.conf")],
                               capture_output=True, text=True)  # fmt: skip
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen(
            [NGINX, "-p", str(t), "-c", str(t / "nginx.conf")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.error_log()
            try:
                httpx.get(self.url + "/", timeout=1.0)
                return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise TimeoutError("nginx did not listen:\n" + self.error_log())

    def error_log(self) -> str:
        p = self.tmp / "error.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful; workers exit with the master
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


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

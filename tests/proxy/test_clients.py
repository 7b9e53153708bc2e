"""Real clients: the openai SDK through a parking upstream, and nginx in front."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from sidecar.server import Sidecar, ephemeral_config, run_in_thread
from tests.proxy.fake_upstream import FakeUpstream, Script, fake_upstream_in_thread, sse_head


def openai_chunk(i: int, content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    if i == 0:
        delta["role"] = "assistant"
    payload = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "fake",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def parking_chat(words: list[str], park_after: int, park: float) -> Script:
    s: Script = [sse_head()]
    for i, w in enumerate(words):
        if i == park_after:
            s += [("send", b": preempted\n\n"), ("sleep", park), ("send", b": resumed\n\n")]
        s.append(("send", openai_chunk(i, w)))
    s += [("send", openai_chunk(len(words), None, "stop")), ("send", b"data: [DONE]\n\n"), ("end",)]
    return s


@pytest.mark.anyio
async def test_openai_sdk_streams_through_a_park(fake: FakeUpstream, sidecar: Sidecar) -> None:
    openai = pytest.importorskip("openai")
    words = ["Hello", ",", " parked", " world", "!"]
    fake.route("/v1/chat/completions", parking_chat(words, park_after=2, park=2.5))
    client = openai.AsyncOpenAI(
        base_url=sidecar.url + "/v1", api_key="none", max_retries=0, timeout=10
    )
    try:
        stream = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        got = []
        finish = None
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                got.append(ch.choices[0].delta.content)
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
    finally:
        await client.close()
    assert got == words
    assert finish == "stop"
    assert sidecar.metrics.parks._value.get() == 1
    assert sidecar.metrics.keepalives.labels("park")._value.get() >= 2


# ------------------------------------------------------------------------ nginx

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)

NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:{port};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_buffering off;
        proxy_read_timeout 2s;
        location /via-sidecar/ {{ proxy_pass http://{sidecar}/; }}
        location /direct/ {{ proxy_pass http://{upstream}/; }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def nginx(sidecar: str, upstream: str, **extra: str) -> Iterator[str]:
    """A real nginx on a free port proxying /via-sidecar/ and /direct/; yields its URL."""
    if NGINX is None:
        pytest.skip("nginx binary not found (apt-get install nginx-light)")
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, sidecar=sidecar, upstream=upstream))
        proc = subprocess.Popen(
            [NGINX, "-p", tmp, "-c", str(conf), "-e", f"{tmp}/error.log"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log = (
                            (Path(tmp) / "error.log").read_text()
                            if (Path(tmp) / "error.log").exists()
                            else ""
                        )
                        pytest.fail(f"nginx did not start: {log}")
                    time.sleep(0.05)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _stream(url: str) -> tuple[bytes, Exception | None]:
    body = b""
    try:
        with httpx.Client(timeout=30) as c, c.stream("POST", url, json={"stream": True}) as r:
            assert r.status_code == 200
            for part in r.iter_raw():
                body += part
    except httpx.HTTPError as exc:
        return body, exc
    return body, None


@pytest.mark.nginx
@pytest.mark.slow
def test_nginx_read_timeout_survives_only_through_sidecar() -> None:
    words = ["a", "b", "c", "d"]
    script = parking_chat(words, park_after=2, park=6.0)
    with fake_upstream_in_thread() as fake:
        fake.route("/v1/chat/completions", script)
        with run_in_thread(ephemeral_config(fake.url)) as sc:
            sidecar_hostport = sc.url.removeprefix("http://")
            upstream_hostport = fake.url.removeprefix("http://")
            with nginx(sidecar_hostport, upstream_hostport) as base:
                via, via_err = _stream(base + "/via-sidecar/v1/chat/completions")
                direct, direct_err = _stream(base + "/direct/v1/chat/completions")
    # through the sidecar: complete, with keepalives during the 6 s park
    assert via_err is None
    assert via.endswith(b"data: [DONE]\n\n")
    assert b": preempted\n\n" in via
    assert b": resumed\n\n" in via
    assert via.count(b": preempt-keepalive\n\n") >= 5
    # straight to the upstream: nginx's 2 s read timeout cuts the parked stream
    assert b"data: [DONE]" not in direct
    assert b": preempted\n\n" in direct
    assert direct_err is not None

"""Real clients: the openai SDK through a parking upstream, and nginx in front."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fake_upstream import FakeUpstream, Script, fake_upstream_in_thread, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.memnet import http_client
from tests.support.nginx import NGINX, Nginx
from tests.support.procs import free_port
from tests.support.samples import sample
from tests.support.sidecar import ephemeral_config, run_in_thread


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
@pytest.mark.in_memory
async def test_openai_sdk_streams_through_a_park(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    openai = pytest.importorskip("openai")
    words = ["Hello", ",", " parked", " world", "!"]
    # a park of three park-keepalive intervals and more
    fake.route("/v1/chat/completions", parking_chat(words, park_after=2, park=1.0))
    async with sidecar_factory(fake.url, park_keepalive=0.3) as sidecar:
        got, finish = await openai_stream(openai, sidecar.url)
    assert got == words
    assert finish == "stop"
    assert sample(sidecar, "parks_total") == 1
    assert sample(sidecar, "keepalives_total", reason="park") >= 2


async def openai_stream(openai: Any, url: str) -> tuple[list[str], str | None]:
    """The content pieces and the finish reason of a streamed chat through the SDK."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10,
                                http_client=http_client())  # fmt: skip
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
    return got, finish


# ------------------------------------------------------------------------ nginx

# A server block of its own: the read timeout cut to 1 s, one route through the sidecar and
# one straight to the upstream.
SITE = """
server {{
    listen 127.0.0.1:{port};
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    proxy_read_timeout 1s;
    location /via-sidecar/ {{ proxy_pass http://{sidecar}/; }}
    location /direct/ {{ proxy_pass http://{upstream}/; }}
}}
"""


@contextmanager
def nginx(sidecar: str, upstream: str) -> Iterator[str]:
    """A real nginx on a free port proxying /via-sidecar/ and /direct/; yields its URL."""
    if NGINX is None:
        pytest.skip("nginx binary not found (apt-get install nginx-light)")
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        site = SITE.format(port=port, sidecar=sidecar, upstream=upstream)
        server = Nginx(Path(tmp), site, port).start()
        try:
            yield server.url
        finally:
            server.stop()


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
    # a park of three read timeouts and six park-keepalive intervals
    script = parking_chat(words, park_after=2, park=3.0)
    with fake_upstream_in_thread() as fake:
        fake.route("/v1/chat/completions", script)
        with run_in_thread(ephemeral_config(fake.url, park_keepalive=0.5)) as sc:
            sidecar_hostport = sc.url.removeprefix("http://")
            upstream_hostport = fake.url.removeprefix("http://")
            # both at once: the direct one is cut while the other is parked
            with nginx(sidecar_hostport, upstream_hostport) as base, ThreadPoolExecutor(2) as pool:
                via_f = pool.submit(_stream, base + "/via-sidecar/v1/chat/completions")
                direct_f = pool.submit(_stream, base + "/direct/v1/chat/completions")
                via, via_err = via_f.result()
                direct, direct_err = direct_f.result()
    # through the sidecar: complete, with keepalives during the 3 s park
    assert via_err is None
    assert via.endswith(b"data: [DONE]\n\n")
    assert b": preempted\n\n" in via
    assert b": resumed\n\n" in via
    assert via.count(b": preempt-keepalive\n\n") >= 5
    # straight to the upstream: nginx's 1 s read timeout cuts the parked stream
    assert b"data: [DONE]" not in direct
    assert b": preempted\n\n" in direct
    assert direct_err is not None

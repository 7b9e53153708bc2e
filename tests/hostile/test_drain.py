"""The drain, as the docs describe it: out of rotation at once, and a second signal ends it.

On SIGTERM ``/ready`` used to stay 200 for the whole drain (a balancer kept sending new
requests to a sidecar that refused them), and a second SIGTERM still waited for the whole
``--drain-timeout``: the second signal set a timeout of 0 that the running wait never read.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from urllib.parse import urlsplit

import anyio
import httpx
import pytest

from sidecar.core.readiness import PARKED
from tests.support.fake_upstream import FakeUpstream, fake_upstream_in_thread, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.rawclient import RawConn
from tests.support.sidecar import ephemeral_config, start_subprocess

METRICS = [("head", 200, [(b"Content-Type", b"text/plain")]),
           ("send", f"{PARKED} 0\n".encode()), ("end",)]  # fmt: skip
STREAM = [sse_head(), ("send", b"data: 1\n\n"), ("hang",)]


@pytest.mark.anyio
async def test_ready_is_503_as_soon_as_the_drain_starts(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/metrics", METRICS)
    fake.route("/v1/chat/completions", STREAM)
    async with (
        sidecar_factory(fake.url, ready_poll=0.1, drain_timeout=30) as sc,
        httpx.AsyncClient() as http,
        await RawConn.open(sc.url) as c,
    ):
        assert sc.metrics_url is not None
        ready = sc.metrics_url.replace("/metrics", "/ready")
        with anyio.fail_after(10):
            while (await http.get(ready)).status_code != 200:
                await anyio.sleep(0.05)
        # a stream is running, so the drain waits for it
        await c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                     b"\r\n{}")  # fmt: skip
        await c.read_until(b"data: 1")
        sc.drain()
        async with httpx.AsyncClient() as fresh:  # a new connection, the very next request
            r = await fresh.get(ready)
        assert r.status_code == 503
        assert "draining" in r.text
        # a health check on a kept-alive connection gets the answer too, not a reset
        assert (await http.get(ready)).status_code == 503
        assert "llama_sidecar_ready 0.0" in (await http.get(sc.metrics_url)).text
        assert (await http.get(sc.metrics_url.replace("/metrics", "/healthz"))).status_code == 200
        assert sc.ctx.active == 1  # the stream still runs


def test_a_second_sigterm_ends_the_drain_at_once() -> None:
    with fake_upstream_in_thread() as fake:
        fake.route("/v1/chat/completions", STREAM)
        config = ephemeral_config(fake.url, drain_timeout=120.0)
        proc = start_subprocess(config)
        try:
            url = urlsplit(proc.url)
            assert url.hostname
            assert url.port
            with socket.create_connection((url.hostname, url.port), timeout=10) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: 2\r\n\r\n{}")  # fmt: skip
                got = b""
                while b"data: 1" not in got:
                    got += s.recv(4096)  # the stream is running
                os.kill(proc.pid, signal.SIGTERM)
                time.sleep(1.0)
                assert proc.alive(), "the drain waits for the stream"
                os.kill(proc.pid, signal.SIGTERM)
                deadline = time.monotonic() + 20  # far below the 120 s drain
                while proc.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not proc.alive(), "a second SIGTERM must stop at once"
            records = [json.loads(line.split(" sidecar.access ", 1)[1])
                       for line in proc.lines if " sidecar.access " in line]  # fmt: skip
            assert [r["outcome"] for r in records] == ["cancelled"]
        finally:
            proc.terminate(timeout=5)

"""``--send-timeout``: a client that stops reading no longer holds its upstream for ever.

A client that sent its request and then stopped reading its response kept the upstream
connection (a llama-server slot) for as long as it liked: the relay waited for the kernel
buffer to drain and reading from upstream stayed paused.  nginx's ``send_timeout`` is the
model: when the client takes no byte for that long, the client connection is closed and the
upstream request cancelled (its connection closed, so llama-server frees the slot), and it
is counted (``outcome`` ``send_timeout``, ``llama_sidecar_send_timeouts_total``).  A slow
reader that keeps taking bytes is never cut.  The tests use a send timeout of a fifth of a
second; the slow reader reads five times as often.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from urllib.parse import urlsplit

import anyio
import pytest

from sidecar.config import Config
from sidecar.proxy.transport import TransportStream
from tests.support.fake_upstream import FakeUpstream, Script, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.samples import sample

pytestmark = pytest.mark.anyio

SEND_TIMEOUT = 0.2
PIECE = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"  # one 64 KiB event


def big_stream(pieces: int) -> Script:
    return [sse_head(), *[("send", PIECE) for _ in range(pieces)], ("end",)]


async def open_client(url: str, rcvbuf: int = 16 * 1024) -> socket.socket:
    """A raw client with a small receive buffer, so that a stall fills the pipe soon."""
    parts = urlsplit(url)
    assert parts.hostname
    assert parts.port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    return sock


REQUEST = b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n"


def access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "sidecar.access"]


def test_the_option_is_in_the_table() -> None:
    assert Config().send_timeout == 60.0  # nginx's default
    assert Config.from_env({"LLAMA_SIDECAR_SEND_TIMEOUT": "2.5"}).send_timeout == 2.5
    with pytest.raises(ValueError, match="send_timeout"):
        Config(send_timeout=0)


async def test_a_stalled_reader_is_cut_off_and_its_upstream_released(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.access")
    fake.route("/v1/chat/completions", big_stream(400))  # 25 MiB: far more than any buffer
    loop = asyncio.get_running_loop()
    async with sidecar_factory(fake.url, send_timeout=SEND_TIMEOUT) as sc:
        sock = await open_client(sc.url)
        try:
            await loop.sock_sendall(sock, REQUEST)
            first = await loop.sock_recv(sock, 4096)
            assert first.startswith(b"HTTP/1.1 200")
            # ... and the client reads no more
            with anyio.fail_after(30):
                while not fake.conns:
                    await anyio.sleep(0.01)
                await fake.conns[0].closed.wait()  # the upstream request was cancelled
                while sc.ctx.active:
                    await anyio.sleep(0.01)
            # the client's connection is gone: what it reads now ends (reset or EOF)
            with anyio.fail_after(30):
                while True:
                    try:
                        if not await loop.sock_recv(sock, 1 << 20):
                            break
                    except ConnectionError:
                        break
        finally:
            sock.close()
        assert sample(sc, "send_timeouts_total") == 1
        disconnects = sc.metrics.client_disconnects.collect()[0].samples
        assert sum(s.value for s in disconnects if s.name.endswith("_total")) == 0
    records = access_records(caplog)
    assert [(r["status"], r["outcome"]) for r in records] == [(200, "send_timeout")]


async def test_a_slow_reader_that_keeps_reading_is_never_cut(
    fake: FakeUpstream,
    sidecar_factory: SidecarFactory,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Progress is counted in bytes: reading 64 KiB every 0.04 s is slow, not stalled.

    The client's socket stays writable only once megabytes of the kernel's send buffer
    drained (at this pace, longer than the send timeout); the check counts what the
    client acknowledged instead.
    """
    caplog.set_level(logging.INFO, logger="sidecar.access")
    checks: list[bool] = []
    check = TransportStream._send_check

    def counted(self: TransportStream) -> None:
        checks.append(True)
        check(self)

    monkeypatch.setattr(TransportStream, "_send_check", counted)
    pieces = 80  # 5 MiB
    fake.route("/v1/chat/completions", big_stream(pieces))
    loop = asyncio.get_running_loop()
    async with sidecar_factory(fake.url, send_timeout=SEND_TIMEOUT) as sc:
        sock = await open_client(sc.url, rcvbuf=64 * 1024)  # a full read per wake-up
        got = 0
        try:
            await loop.sock_sendall(sock, REQUEST)
            with anyio.fail_after(120):
                while True:
                    data = await loop.sock_recv(sock, 64 * 1024)
                    if not data:
                        break
                    got += len(data)
                    if data.endswith(b"0\r\n\r\n"):
                        break
                    await anyio.sleep(SEND_TIMEOUT / 5)
        finally:
            sock.close()
        assert got > pieces * len(PIECE)
        # the test means something only if the sidecar had to wait on this client for
        # longer than the send timeout: the check ran, and found progress
        assert checks
        assert sample(sc, "send_timeouts_total") == 0
    assert [r["outcome"] for r in access_records(caplog)] == ["ok"]

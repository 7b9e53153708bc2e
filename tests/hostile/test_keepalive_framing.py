"""Finding 5: keepalive comments only where the client's framing has room for them.

An upstream event stream framed by ``Content-Length`` used to get ``: keepalive``
comments inside the counted body: the client saw a corrupted body and the connection
lost sync, and once the comments had used up the length, h11 raised "Too much data"
inside the timer callback, where nothing saw it, and the keepalives stopped.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from sidecar.proxy.h11stream import H11Stream
from sidecar.proxy.server import Sidecar
from tests.support.fake_upstream import FakeUpstream, chunk, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.rawclient import RawConn
from tests.support.samples import sample

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]

EVENTS = [chunk(0), chunk(1), b": preempted\n\n", b": resumed\n\n", chunk(2), b"data: [DONE]\n\n"]
BODY = b"".join(EVENTS)
CL_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY))  # fmt: skip


def parked_with_length(park: float) -> list[tuple[Any, ...]]:
    """An SSE response framed by Content-Length that parks for ``park`` seconds."""
    return [("raw", CL_HEAD + b"".join(EVENTS[:3])), ("sleep", park),
            ("raw", b"".join(EVENTS[3:])), ("keep",)]  # fmt: skip


async def test_no_keepalive_inside_a_content_length_body(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/v1/chat/completions", parked_with_length(0.8))  # five keepalive intervals
    async with (
        sidecar_factory(fake.url, park_keepalive=0.15) as sc,
        await RawConn.open(sc.url) as c,
    ):
        for _ in range(2):  # the second exchange proves the connection is still in sync
            await c.send(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
            resp = await c.read_response(timeout=10)
            assert resp.status == 200
            assert resp.header(b"content-length") == b"%d" % len(BODY)
            assert resp.body == BODY
        assert sample(sc, "keepalives_total", reason="park") == 0
        assert sample(sc, "parks_total") == 2  # the notices were still seen


async def test_keepalives_in_a_close_delimited_body(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    """An HTTP/1.0 client: the body ends with the connection, so comments may go in."""
    fake.route("/v1/chat/completions", [sse_head(), ("send", EVENTS[0] + EVENTS[2]),
                                        ("sleep", 0.5), ("send", b"".join(EVENTS[3:])),
                                        ("end",)])  # fmt: skip
    async with (
        sidecar_factory(fake.url, park_keepalive=0.15) as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"GET /v1/chat/completions HTTP/1.0\r\n\r\n")
        resp = await c.read_response(timeout=10)
        assert resp.header(b"content-length") is None
        assert not resp.chunked
        assert resp.body.count(b": preempt-keepalive\n\n") >= 2
        assert resp.body.replace(b": preempt-keepalive\n\n", b"") == (
            EVENTS[0] + EVENTS[2] + b"".join(EVENTS[3:])
        )


async def test_a_head_request_gets_no_body_bytes(fake: FakeUpstream, sidecar: Sidecar) -> None:
    fake.route("/v1/chat/completions", [
        ("raw", b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"), ("keep",)])  # fmt: skip
    async with await RawConn.open(sidecar.url) as c:
        await c.send(b"HEAD /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await c.read_response(head_only=True)
        assert resp.status == 200
        await anyio.sleep(0.3)
        await c.send(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await c.read_response()).status == 200  # nothing stray came first


async def test_a_failing_keepalive_ends_the_exchange_not_the_timer(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing may escape a timer callback: the loop would only log it."""
    loop_errors: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    real = H11Stream.write_data

    def failing(self: H11Stream, data: bytes, wire: bytes | None = None) -> None:
        if data.startswith(b": preempt-keepalive"):
            raise RuntimeError("a bug while writing a keepalive")
        real(self, data, wire)

    monkeypatch.setattr(H11Stream, "write_data", failing)
    fake.route("/v1/chat/completions", [sse_head(), ("send", EVENTS[2]), ("sleep", 5),
                                        ("send", EVENTS[3]), ("end",)])  # fmt: skip
    try:
        async with (
            sidecar_factory(fake.url, park_keepalive=0.3) as sc,
            await RawConn.open(sc.url) as c,
        ):
            await c.send(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
            await c.read_until(b"preempted")
            rest = await c.wait_closed(timeout=3)  # ended at once, not after the park
            assert b"0\r\n\r\n" not in rest  # abnormally: no terminating chunk
            with anyio.fail_after(2):
                while fake.conns[-1].closed_at is None:
                    await anyio.sleep(0.01)
            async with await RawConn.open(sc.url) as other:
                await other.send(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await other.read_response()).status == 200
    finally:
        loop.set_exception_handler(None)
    assert loop_errors == []

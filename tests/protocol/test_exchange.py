"""Exchange driven in memory: exact bytes in, exact bytes and metrics out, no sockets."""

from __future__ import annotations

import json

import anyio
import pytest

from sidecar.core.chunked import ChunkedDecoder
from tests.protocol.harness import PEER, Harness, UpstreamEnd

pytestmark = pytest.mark.anyio

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_plain_json_twice_on_one_pooled_upstream_connection() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def upstream(end: UpstreamEnd) -> None:
        while True:
            head, body = await end.read_request()
            seen.append((head, body))
            answer = json.dumps({"content": body.decode()}).encode()
            await end.send(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(answer), answer)
            )

    h = Harness(upstream)
    async with h.client() as c:
        for text in (b"hello", b"again"):
            await c.send(
                b"POST /completion HTTP/1.1\r\nHost: sidecar\r\nConnection: keep-alive\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(text), text)
            )
            resp, body = await c.response()
            assert resp.status_code == 200
            assert json.loads(body) == {"content": text.decode()}
            assert (b"content-length", b"%d" % len(body)) in list(resp.headers)
    assert len(h.upstreams) == 1  # the second request reused the pooled connection
    head, body = seen[0]
    assert head.startswith(b"POST /completion HTTP/1.1\r\n")
    assert b"\r\nX-Forwarded-For: " + PEER.encode() + b"\r\n" in head
    assert b"\r\nX-Forwarded-Proto: http\r\n" in head
    assert b"keep-alive" not in head.lower()  # hop-by-hop field removed
    assert body == b"hello"
    assert h.sample("llama_sidecar_requests_total", route="/completion", status_class="2xx") == 2
    assert h.sample("llama_sidecar_bytes_total", direction="request") == 10
    assert h.sample("llama_sidecar_streams_active") == 0
    assert [x.rec.outcome for x in h.exchanges] == ["ok", "ok"]


async def test_sse_stream_with_park_and_resume_gets_keepalives_between_events() -> None:
    events = [b'data: {"n": 0}\n\n', b": preempted\n\n", b": resumed\n\n", b'data: {"n": 1}\n\n']
    resumed = anyio.Event()

    async def upstream(end: UpstreamEnd) -> None:
        await end.read_request()
        await end.send(SSE_HEAD + chunk(events[0]) + chunk(events[1]))
        await resumed.wait()  # parked until the client has seen keepalives
        await end.send(chunk(events[2]) + chunk(events[3][:7]))  # the event split in two
        await end.send(chunk(events[3][7:]) + b"0\r\n\r\n")

    h = Harness(upstream, park_keepalive=0.02)
    async with h.client() as c:
        await c.send(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        await c.read_until(b"preempted")
        await c.read_until(b": preempt-keepalive\n\n")
        assert h.sample("llama_sidecar_streams_parked") == 1
        assert h.exchanges[0].monitor.phase.value == "parked"
        resumed.set()
        await c.read_until(b"0\r\n\r\n")
    decoder = ChunkedDecoder()
    body = decoder.feed(c.seen.split(b"\r\n\r\n", 1)[1])
    assert decoder.done
    # Without the sidecar's comments the client got upstream's bytes exactly;
    # each comment is a whole block of its own, between two events.
    added = body.count(b": preempt-keepalive\n\n")
    assert added >= 1
    assert body.replace(b": preempt-keepalive\n\n", b"") == b"".join(events)
    parked_part = body.split(b": preempted\n\n", 1)[1].split(b": resumed\n\n", 1)[0]
    assert parked_part == b": preempt-keepalive\n\n" * added
    assert h.sample("llama_sidecar_parks_total") == 1
    assert h.sample("llama_sidecar_resumes_total") == 1
    assert h.sample("llama_sidecar_keepalives_total", reason="park") == added
    assert h.sample("llama_sidecar_upstream_comments_total", kind="preempted") == 1
    assert h.sample("llama_sidecar_streams_parked") == 0
    assert h.sample("llama_sidecar_streams_active") == 0
    rec = h.exchanges[0].rec
    assert (rec.parks, rec.keepalives, rec.outcome) == (1, added, "ok")
    assert rec.parked_seconds > 0


async def test_upstream_refused_is_a_502_json_error() -> None:
    h = Harness(None)
    async with h.client() as c:
        await c.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        resp, body = await c.response()
        rest = await c.read_to_eof()
    assert resp.status_code == 502
    assert resp.reason == b"Bad Gateway"
    assert (b"connection", b"close") in list(resp.headers)
    error = json.loads(body)["error"]
    assert (error["code"], error["type"]) == (502, "unavailable_error")
    assert rest == b""
    assert h.sample("llama_sidecar_upstream_errors_total", kind="connect") == 1
    assert h.sample("llama_sidecar_upstream_up") == 0
    assert h.exchanges[0].rec.outcome == "upstream_connect"


async def test_upstream_dying_mid_stream_leaves_the_response_unterminated() -> None:
    async def upstream(end: UpstreamEnd) -> None:
        await end.read_request()
        await end.send(SSE_HEAD + chunk(b"data: 1\n\n") + b"40\r\ndata: cut")
        await end.close()

    h = Harness(upstream)
    async with h.client() as c:
        await c.send(b"GET /completion HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = await c.read_to_eof()
    assert raw.startswith(b"HTTP/1.1 200 ")
    decoder = ChunkedDecoder()
    # Every byte upstream sent is relayed (a chunk's data as it arrives), then the
    # connection closes without the terminating chunk: the client sees an error.
    assert decoder.feed(raw.split(b"\r\n\r\n", 1)[1]) == b"data: 1\n\ndata: cut"
    assert not decoder.done
    assert decoder.idle
    assert h.sample("llama_sidecar_upstream_errors_total", kind="disconnect") == 1
    assert h.exchanges[0].rec.outcome == "upstream_disconnect"


async def test_client_leaving_while_parked_closes_upstream_at_once() -> None:
    upstream_closed = anyio.Event()

    async def upstream(end: UpstreamEnd) -> None:
        await end.read_request()
        await end.send(SSE_HEAD + chunk(b"data: 1\n\n") + chunk(b": preempted\n\n"))
        await end.wait_closed()  # never resumes: only the sidecar can end this
        upstream_closed.set()

    h = Harness(upstream)
    async with h.client() as c:
        await c.send(b"GET /completion HTTP/1.1\r\nHost: x\r\n\r\n")
        await c.read_until(b": preempted\n\n")
    with anyio.fail_after(5):
        await upstream_closed.wait()
    assert h.sample("llama_sidecar_client_disconnects_total", phase="parked") == 1
    assert h.sample("llama_sidecar_streams_parked") == 0
    assert h.sample("llama_sidecar_park_duration_seconds_count") == 1  # ended by the exit
    assert h.exchanges[0].rec.outcome == "client_disconnected"
    assert h.pool._idle == []  # a connection cut mid-response is never pooled

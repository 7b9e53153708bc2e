"""Finding 8, the smaller ones: framing headers, CONNECT, reason phrases, the 401
challenge, a 16 MB SSE line, and good chunks before a bad one."""

from __future__ import annotations

import logging
import time

import anyio
import pytest

from sidecar.core.readiness import PARKED, Readiness
from sidecar.core.sse import MAX_KEPT, Comment, SSEScanner
from sidecar.proxy.ready_poll import poll_upstream
from sidecar.proxy.server import Sidecar
from sidecar.proxy.upstream import UpstreamPool
from tests.support.fake_upstream import FakeUpstream, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.memnet import http_client
from tests.support.rawclient import RawConn
from tests.support.samples import sample
from tests.support.sidecar import ephemeral_config

SSE_CHUNKED_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip


@pytest.mark.anyio
@pytest.mark.in_memory
@pytest.mark.parametrize("option", [b"content-length", b"Content-Length, keep-alive"])
async def test_connection_never_strips_the_body_length(
    fake: FakeUpstream, sidecar: Sidecar, option: bytes
) -> None:
    async with await RawConn.open(sidecar.url) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: " + option +
                     b"\r\nContent-Length: 5\r\n\r\nhello")  # fmt: skip
        resp = await c.read_response()
        assert (resp.status, resp.body) == (200, b"hello")
    req = fake.requests[-1]
    assert req.body == b"hello"
    assert dict((n.lower(), v) for n, v in req.headers)[b"content-length"] == b"5"


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_connect_is_refused_not_relayed(fake: FakeUpstream, sidecar: Sidecar) -> None:
    async with await RawConn.open(sidecar.url) as c:
        await c.send(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        resp = await c.read_response()
        assert (resp.status, resp.reason) == (501, b"Not Implemented")
        assert resp.header(b"connection") == b"close"
        assert b"CONNECT" in resp.body
        assert await c.wait_closed() == b""
    assert fake.conns == []


@pytest.mark.anyio
@pytest.mark.in_memory
@pytest.mark.parametrize(
    ("request_bytes", "status", "reason"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, b"Bad Request"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 40_000 + b"\r\n\r\n", 431,
         b"Request Header Fields Too Large"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, b"Not Implemented"),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n", 413, None),
    ],
)  # fmt: skip
async def test_error_responses_carry_a_reason_phrase(
    sidecar: Sidecar, request_bytes: bytes, status: int, reason: bytes | None
) -> None:
    async with await RawConn.open(sidecar.url) as c:
        await c.send(request_bytes)
        resp = await c.read_response()
        assert resp.status == status
        assert resp.reason if reason is None else resp.reason == reason


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_upstream_down_is_a_502_with_its_reason(sidecar_factory: SidecarFactory) -> None:
    async with (
        sidecar_factory("http://127.0.0.1:9") as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await c.read_response()
        assert (resp.status, resp.reason) == (502, b"Bad Gateway")


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_401_carries_the_bearer_challenge(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    async with (
        sidecar_factory(fake.url, api_key="k") as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await c.read_response()
        assert (resp.status, resp.reason) == (401, b"Unauthorized")
        assert resp.header(b"www-authenticate") == b"Bearer"


@pytest.mark.parametrize("method", ["feed", "feed_comments"])
def test_a_16_mb_line_costs_linear_time_and_bounded_memory(method: str) -> None:
    """The scanner used to copy ``_partial + data`` on every read: 0.25 s per MB."""
    scanner = SSEScanner()
    feed = getattr(scanner, method)
    piece = b"x" * 65536
    t0 = time.process_time()
    feed(b": ")
    for _ in range(256):  # 16 MB, no newline
        feed(piece)
        assert len(scanner._partial) <= MAX_KEPT
    assert not scanner.at_boundary
    out = feed(b"\n\n: preempted\n\n")
    took = time.process_time() - t0
    assert took < 1.0, f"{took:.2f} s of CPU for 16 MB"
    assert scanner.at_boundary
    texts = out if method == "feed_comments" else [x.text for x in out if type(x) is Comment]
    assert texts[-1] == b" preempted"
    assert len(texts[0]) == MAX_KEPT - 1  # cut (the ":" is not in the text), still a comment


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_a_16_mb_line_is_relayed_intact(fake: FakeUpstream, sidecar: Sidecar) -> None:
    line = b"data: " + b"y" * (16 * 1024 * 1024) + b"\n\n"
    fake.route("/v1/chat/completions", [sse_head(), ("send", line), ("send", b": preempted\n\n"),
                                        ("send", b": resumed\n\n"), ("end",)])  # fmt: skip
    async with await RawConn.open(sidecar.url) as c:
        await c.send(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await c.read_response(timeout=60)
        assert resp.body == line + b": preempted\n\n: resumed\n\n"
    assert sample(sidecar, "parks_total") == 1


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_good_chunks_before_a_bad_one_are_delivered(
    fake: FakeUpstream, sidecar: Sidecar
) -> None:
    fake.route("/v1/chat/completions", [
        ("raw", SSE_CHUNKED_HEAD), ("sleep", 0.05),
        ("raw", b"d\r\ndata: hello\n\n\r\nd\r\ndata: world\n\n\r\nzz\r\nbroken"),
        ("hang",)])  # fmt: skip
    async with await RawConn.open(sidecar.url) as c:
        await c.send(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        await c.read_until(b"\r\n\r\n")
        rest = await c.wait_closed(timeout=5)
        assert b"data: hello\n\n" in rest
        assert b"data: world\n\n" in rest
        assert not rest.endswith(b"0\r\n\r\n")  # ended abnormally: no terminating chunk
    with anyio.fail_after(2):
        while sidecar.ctx.active:
            await anyio.sleep(0.01)
    assert sample(sidecar, "upstream_errors_total", kind="protocol") == 1


@pytest.mark.anyio
@pytest.mark.in_memory
@pytest.mark.parametrize(
    "request_bytes",
    [
        # obs-fold (RFC 9112 section 5.2): a header line starting with a space or a tab
        b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n 2\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n\t2\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n 3\r\n\r\nabc",
        # Transfer-Encoding in HTTP/1.0 (RFC 9112 section 6.1): faulty framing
        b"POST /echo HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\n\r\n",
    ],
    ids=["obs_fold_space", "obs_fold_tab", "obs_fold_length", "http10_transfer_encoding"],
)
async def test_obs_fold_and_http10_chunked_are_refused(
    fake: FakeUpstream, sidecar: Sidecar, request_bytes: bytes
) -> None:
    async with await RawConn.open(sidecar.url) as c:
        await c.send(request_bytes)
        resp = await c.read_response()
        assert (resp.status, resp.reason) == (400, b"Bad Request")
        assert resp.header(b"connection") == b"close"
        assert await c.wait_closed() == b""
    assert fake.requests == []  # never forwarded


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_a_space_inside_a_header_value_is_not_a_fold(
    fake: FakeUpstream, sidecar: Sidecar
) -> None:
    async with await RawConn.open(sidecar.url) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-A: 1 2\t3\r\nContent-Length: 4\r\n\r\n"
                     b"a\n b")  # fmt: skip
        resp = await c.read_response()
        assert (resp.status, resp.body) == (200, b"a\n b")  # the body may hold anything
    assert dict(fake.requests[0].headers)[b"X-A"] == b"1 2\t3"


@pytest.mark.anyio
async def test_the_readiness_poller_does_not_log_each_poll(
    fake: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx logs every request at INFO: a poller on it would add one line a second, 86,400
    a day.  The poller reads through the proxy's own upstream pool, which logs no request;
    any httpx request in the process keeps its INFO line.
    """
    fake.route("/metrics", [("head", 200, [(b"Content-Type", b"text/plain")]),
                            ("send", f"{PARKED} 0\n".encode()), ("end",)])  # fmt: skip
    readiness = Readiness(0.05)
    caplog.set_level(logging.INFO)
    pool = UpstreamPool(ephemeral_config(fake.url))
    with anyio.move_on_after(0.5):
        await poll_upstream(readiness, pool)
    await pool.aclose()
    assert len(fake.requests) >= 3  # polls happened (their verdict is not this test's business)
    assert [r for r in caplog.records if r.name.startswith("httpx")] == []
    assert [r for r in caplog.records if r.levelno < logging.WARNING] == []
    async with http_client() as other:
        await other.get(fake.url + "/metrics")
    assert any(r.name == "httpx" and r.levelno == logging.INFO for r in caplog.records)

"""Finding 3: an upstream connection with stray bytes is never pooled.

A lying upstream writes more than its response: a body longer than ``Content-Length``,
a body after a 204, a 304 or a HEAD response, bytes after the last chunk.  If the
sidecar pooled that connection, the *next, unrelated* client would read the forged
bytes as its response.  Each case: client A gets the lie's response, then client B, on
another connection, must get its own answer from a fresh upstream connection.
"""

from __future__ import annotations

import os

import anyio
import pytest

from sidecar.proxy.server import Sidecar
from tests.support.fake_upstream import FakeUpstream, Script, sse_head
from tests.support.rawclient import RawConn

pytestmark = pytest.mark.anyio

FORGED = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nX-Forged: yes\r\n\r\nforged"

LIES: dict[str, tuple[bytes, Script, bytes]] = {
    # name: (client A's method, the upstream's answer, the body client A must get)
    "longer_than_content_length": (
        b"GET", [("raw", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello" + FORGED), ("keep",)],
        b"hello",
    ),
    "body_after_204": (
        b"GET", [("raw", b"HTTP/1.1 204 No Content\r\n\r\n" + FORGED), ("keep",)], b"",
    ),
    "body_after_304": (
        b"GET", [("raw", b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n" + FORGED), ("keep",)],
        b"",
    ),
    "body_after_head_response": (
        b"HEAD", [("raw", b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n" + FORGED), ("keep",)],
        b"",
    ),
    "bytes_after_the_last_chunk": (
        b"GET",
        [("raw", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"5\r\nhello\r\n0\r\n\r\n" + FORGED), ("keep",)],
        b"hello",
    ),
    "bytes_after_an_event_stream": (
        b"GET",
        [("raw", b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n"
                 b"d\r\ndata: hello\n\n\r\n0\r\n\r\n" + FORGED), ("keep",)],
        b"data: hello\n\n",
    ),
    "longer_than_content_length_later": (
        b"GET",
        [("raw", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"), ("sleep", 0.05),
         ("raw", FORGED), ("keep",)],
        b"hello",
    ),
}  # fmt: skip


@pytest.mark.parametrize("lie", list(LIES))
async def test_stray_bytes_never_reach_the_next_client(
    fake: FakeUpstream, sidecar: Sidecar, lie: str
) -> None:
    method, script, body_a = LIES[lie]
    fake.route("/lie", script)
    async with await RawConn.open(sidecar.url) as a:
        await a.send(method + b" /lie HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await a.read_response(head_only=method == b"HEAD")
        assert resp.header(b"x-forged") is None
        assert resp.body == body_a
    await anyio.sleep(0.2)  # the connection is back in the pool by now, if pooled
    async with await RawConn.open(sidecar.url) as b:
        await b.send(b"POST /next HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nmine")
        resp = await b.read_response()
        assert resp.header(b"x-forged") is None, "client B got the forged response"
        assert (resp.status, resp.body) == (200, b"mine")
    assert [r.target for r in fake.conns[-1].requests] == [b"/next"]  # a fresh connection
    assert len(fake.conns) == 2


@pytest.mark.in_memory
async def test_both_content_length_and_chunked_loses_the_length(
    fake: FakeUpstream, sidecar: Sidecar
) -> None:
    """RFC 9112 section 6.3: chunked wins; the length is removed and the connection dropped."""
    fake.route("/both", [("raw", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n"
                                  b"5\r\nhello\r\n0\r\n\r\n"), ("keep",)])  # fmt: skip
    async with await RawConn.open(sidecar.url) as a:
        await a.send(b"GET /both HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await a.read_response(timeout=5)
        assert resp.header(b"content-length") is None
        assert resp.chunked
        assert resp.body == b"hello"
        await a.send(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")  # client side still in sync
        assert (await a.read_response()).status == 200
    assert [r.target for r in fake.conns[-1].requests] == [b"/next"]


@pytest.mark.in_memory
async def test_an_unfinished_body_is_never_pooled(fake: FakeUpstream, sidecar: Sidecar) -> None:
    """The client leaves mid-body: the rest of that body must not become B's response."""
    fake.route("/long", [sse_head(), ("send", b"data: 1\n\n"), ("sleep", 0.3),
                         ("send", b"data: 2\n\n" + FORGED), ("end",)])  # fmt: skip
    async with await RawConn.open(sidecar.url) as a:
        await a.send(b"GET /long HTTP/1.1\r\nHost: x\r\n\r\n")
        await a.read_until(b"data: 1")
    async with await RawConn.open(sidecar.url) as b:
        await b.send(b"POST /next HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nmine")
        resp = await b.read_response()
        assert (resp.status, resp.body) == (200, b"mine")
    assert [r.target for r in fake.conns[-1].requests] == [b"/next"]


@pytest.mark.in_memory
async def test_clean_responses_are_still_pooled(fake: FakeUpstream, sidecar: Sidecar) -> None:
    """The fix must not switch pooling off: exact responses reuse one connection."""
    for i in range(3):
        async with await RawConn.open(sidecar.url) as c:
            await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d" % i)
            assert (await c.read_response()).body == b"%d" % i
    assert len(fake.conns) == 1


async def test_pooled_connections_are_reused_past_descriptor_1024(
    fake: FakeUpstream, sidecar: Sidecar
) -> None:
    """The reuse check must work for any descriptor: ``select()`` fails from 1024 up.

    Low descriptors are taken up so that the sidecar's upstream socket gets one above
    1024; three requests in a row must then share one upstream connection (with
    ``select()`` every check failed and each request opened a new one).
    """
    fillers: list[int] = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY)
            fillers.append(fd)
            if fd >= 1100:
                break
        for _ in range(3):
            async with await RawConn.open(sidecar.url) as c:
                await c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                resp = await c.read_response()
                assert resp.status == 200
        assert len(fake.conns) == 1
    finally:
        for fd in fillers:
            os.close(fd)

"""Plain HTTP relaying through the sidecar against the scripted fake upstream."""

from __future__ import annotations

import json
import os

import anyio
import anyio.lowlevel
import httpx
import pytest

from sidecar.proxy.server import Sidecar
from tests.support.fake_upstream import FakeUpstream, chunk, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.memnet import http_client
from tests.support.rawclient import RawConn, status_of

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]


async def test_json_passthrough_byte_identical(fake: FakeUpstream, sidecar: Sidecar) -> None:
    body = b'{"b": 1,   "a":[1,2, 3],"s":"\\u00e9\xc3\xa9"}'
    fake.route(
        "/props",
        [
            ("head", 200, [(b"Content-Type", b"application/json"), (b"X-Custom", b"v1"),
                           (b"Content-Length", str(len(body)).encode())]),
            ("send", body),
            ("end",),
        ],
    )  # fmt: skip
    async with http_client() as c:
        r = await c.get(sidecar.url + "/props")
    assert r.status_code == 200
    assert r.content == body
    assert r.headers["x-custom"] == "v1"
    assert r.headers["content-length"] == str(len(body))
    assert r.headers["content-type"] == "application/json"


async def test_request_headers_forwarded(fake: FakeUpstream, sidecar: Sidecar) -> None:
    async with http_client() as c:
        r = await c.post(
            sidecar.url + "/echo?x=1",
            content=b"abc",
            headers={"X-Thing": "1", "Connection": "keep-alive, X-Hop", "X-Hop": "drop me",
                     "Keep-Alive": "timeout=5", "X-Forwarded-For": "10.0.0.1"},
        )  # fmt: skip
    assert r.content == b"abc"
    req = fake.requests[-1]
    assert req.target == b"/echo?x=1"
    names = {n.lower(): v for n, v in req.headers}
    assert names[b"x-thing"] == b"1"
    assert b"x-hop" not in names
    assert b"keep-alive" not in names
    assert names[b"x-forwarded-for"] == b"10.0.0.1, 127.0.0.1"
    assert names[b"x-forwarded-proto"] == b"http"
    assert names[b"content-length"] == b"3"


async def test_large_bodies_both_ways(fake: FakeUpstream, sidecar: Sidecar) -> None:
    body = os.urandom(8 * 1024 * 1024)
    async with http_client(timeout=30) as c:
        r = await c.post(sidecar.url + "/echo", content=body)
    assert r.status_code == 200
    assert len(r.content) == len(body)
    assert r.content == body
    assert fake.requests[-1].body == body


async def test_large_streamed_response(fake: FakeUpstream, sidecar: Sidecar) -> None:
    part = os.urandom(64 * 1024)
    fake.route("/big", [("head", 200, [(b"Content-Type", b"application/octet-stream")]),
                        *[("send", part)] * 128, ("end",)])  # fmt: skip
    async with http_client(timeout=30) as c:
        r = await c.get(sidecar.url + "/big")
    assert r.content == part * 128
    assert r.headers["transfer-encoding"] == "chunked"


async def test_chunked_upload(fake: FakeUpstream, sidecar: Sidecar) -> None:
    async def gen():  # type: ignore[no-untyped-def]
        for i in range(50):
            yield f"piece{i};".encode()
            await anyio.lowlevel.checkpoint()

    async with http_client() as c:
        r = await c.post(sidecar.url + "/echo", content=gen())
    expected = b"".join(f"piece{i};".encode() for i in range(50))
    assert r.content == expected
    # Buffered, then sent upstream with its length (as nginx's request buffering does).
    names = {n.lower(): v for n, v in fake.requests[-1].headers}
    assert b"transfer-encoding" not in names
    assert names[b"content-length"] == b"%d" % len(expected)
    assert fake.requests[-1].body == expected


async def test_keepalive_reuse_both_sides(fake: FakeUpstream, sidecar: Sidecar) -> None:
    conn = await RawConn.open(sidecar.url)
    try:
        for i in range(5):
            body = f"n{i}".encode()
            await conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n" + body)
            head = await conn.read_until(b"\r\n\r\n")
            assert status_of(head) == 200
            assert await conn.read_until(body) == body
    finally:
        await conn.close()
    # one client connection carried 5 requests; upstream reused one connection
    assert len(fake.conns) == 1
    assert len(fake.conns[0].requests) == 5


async def test_pipelined_requests(fake: FakeUpstream, sidecar: Sidecar) -> None:
    conn = await RawConn.open(sidecar.url)
    try:
        req = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n"
        await conn.send(req + b"one" + req + b"two")
        for body in (b"one", b"two"):
            assert status_of(await conn.read_until(b"\r\n\r\n")) == 200
            assert await conn.read_until(body) == body
    finally:
        await conn.close()


async def test_expect_100_continue(fake: FakeUpstream, sidecar: Sidecar) -> None:
    conn = await RawConn.open(sidecar.url)
    try:
        await conn.send(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await conn.read_until(b"\r\n\r\n")
        assert status_of(interim) == 100
        await conn.send(b"hello")
        assert status_of(await conn.read_until(b"\r\n\r\n")) == 200
        assert await conn.read_until(b"hello") == b"hello"
    finally:
        await conn.close()
    names = {n.lower() for n, _ in fake.requests[-1].headers}
    assert b"expect" not in names


async def test_expect_100_rejected_before_body(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    async with sidecar_factory(fake.url, max_body=10) as sc:
        conn = await RawConn.open(sc.url)
        try:
            await conn.send(
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n"
                b"Expect: 100-continue\r\n\r\n"
            )
            assert status_of(await conn.read_until(b"\r\n\r\n")) == 413
        finally:
            await conn.close()
    assert fake.requests == []


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_head_request(fake: FakeUpstream, sidecar: Sidecar, method: str) -> None:
    body = b'{"status":"ok"}'
    fake.route("/health", [("head", 200, [(b"Content-Type", b"application/json"),
                                          (b"Content-Length", str(len(body)).encode())]),
                           ("send", body if method == "GET" else b""), ("end",)])  # fmt: skip
    async with http_client() as c:
        r = await c.request(method, sidecar.url + "/health")
        r2 = await c.get(sidecar.url + "/echo")  # connection still usable afterwards
    assert r.status_code == 200
    assert r.headers["content-length"] == str(len(body))
    assert r.content == (body if method == "GET" else b"")
    assert r2.status_code == 200


@pytest.mark.parametrize("status", [204, 304])
async def test_no_body_statuses(fake: FakeUpstream, sidecar: Sidecar, status: int) -> None:
    fake.route("/nb", [("head", status, [(b"ETag", b'"x"')]), ("end",)])
    conn = await RawConn.open(sidecar.url)
    try:
        for _ in range(2):  # twice on one connection: no stray body bytes in between
            await conn.send(b"GET /nb HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await conn.read_until(b"\r\n\r\n")
            assert status_of(head) == status
            assert b"etag" in head.lower()
            assert b"transfer-encoding" not in head.lower()
    finally:
        await conn.close()


async def test_connect_refused_gives_502_json(sidecar_factory: SidecarFactory) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with sidecar_factory(f"http://127.0.0.1:{port}") as sc, http_client() as c:
        r = await c.post(sc.url + "/v1/chat/completions", json={"stream": True})
    assert r.status_code == 502
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == 502
    assert "connect" in err["message"]


async def test_upstream_dies_mid_stream(fake: FakeUpstream, sidecar: Sidecar) -> None:
    fake.route("/die", [sse_head(), ("send", chunk(0)), ("sleep", 0.1), ("die",)])
    fake.route("/ok", [sse_head(), *[("send", chunk(i)) for i in range(5)], ("sleep", 0.3),
                       *[("send", chunk(i)) for i in range(5, 10)], ("end",)])  # fmt: skip

    async def good() -> bytes:
        async with http_client() as c:
            r = await c.get(sidecar.url + "/ok")
            return r.content

    async with anyio.create_task_group() as tg:
        results: list[bytes] = []

        async def run_good() -> None:
            results.append(await good())

        tg.start_soon(run_good)
        async with http_client() as c, c.stream("GET", sidecar.url + "/die") as r:
            assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                await r.aread()
    assert results == [b"".join(chunk(i) for i in range(10))]
    # the sidecar still serves
    async with http_client() as c:
        assert (await c.get(sidecar.url + "/echo")).status_code == 200


async def raw_exchange(url: str, data: bytes) -> tuple[int, bytes, bool]:
    """Send raw bytes; return (status, whole response, closed by server)."""
    conn = await RawConn.open(url)
    try:
        await conn.send(data)
        out = await conn.read_to_eof(timeout=5)
    finally:
        await conn.close()
    return status_of(out), out, True


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"0\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n", 431),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    ],
    ids=["garbage", "bad-header", "cl-and-te", "two-cl", "bad-cl", "huge-header", "te-gzip"],
)  # fmt: skip
async def test_bad_requests(fake: FakeUpstream, sidecar: Sidecar, data: bytes, status: int) -> None:
    got, out, closed = await raw_exchange(sidecar.url, data)
    assert got == status, out
    assert closed
    assert b"connection: close" in out.lower()
    assert fake.requests == []


async def test_body_over_limit(fake: FakeUpstream, sidecar_factory: SidecarFactory) -> None:
    async with sidecar_factory(fake.url, max_body=1000) as sc:
        got, _, _ = await raw_exchange(
            sc.url, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n" + b"a" * 1001
        )
        assert got == 413
        # chunked: discovered while streaming
        body = b"".join(b"%x\r\n%s\r\n" % (300, b"b" * 300) for _ in range(5)) + b"0\r\n\r\n"
        got, _, _ = await raw_exchange(
            sc.url, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body
        )
        assert got == 413


async def test_slow_headers_408(fake: FakeUpstream, sidecar_factory: SidecarFactory) -> None:
    async with sidecar_factory(fake.url, header_timeout=0.5) as sc:
        conn = await RawConn.open(sc.url)
        try:
            await conn.send(b"GET /echo HTTP/1.1\r\nHost: x\r\n")
            out = await conn.read_to_eof(timeout=5)
        finally:
            await conn.close()
    assert status_of(out) == 408


async def test_idle_connection_closed_quietly(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    async with sidecar_factory(fake.url, header_timeout=0.3) as sc:
        conn = await RawConn.open(sc.url)
        try:
            assert await conn.read_to_eof(timeout=5) == b""
        finally:
            await conn.close()


async def test_api_key(fake: FakeUpstream, sidecar_factory: SidecarFactory) -> None:
    async with sidecar_factory(fake.url, api_key="s3cret") as sc, http_client() as c:
        r = await c.post(sc.url + "/echo", content=b"x")
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        r = await c.post(sc.url + "/echo", content=b"x", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        assert fake.requests == []
        r = await c.post(sc.url + "/echo", content=b"x", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        r = await c.post(sc.url + "/echo", content=b"y", headers={"X-Api-Key": "s3cret"})
        assert r.status_code == 200
        fake.route(
            "/health", [("head", 200, [(b"Content-Length", b"2")]), ("send", b"ok"), ("end",)]
        )
        assert (await c.get(sc.url + "/health")).status_code == 200
    assert len(fake.requests) == 3


async def test_pooled_upstream_adds_no_headers(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    """Bodies of every framing on reused upstream connections; nothing added to the head."""
    fake.route("/s", [sse_head(), ("send", chunk(0)), ("send", b": preempted\n\n"),
                      ("send", b": resumed\n\n"), ("send", chunk(1)), ("end",)])  # fmt: skip
    async with sidecar_factory(fake.url) as sc, http_client() as c:
        r = await c.post(sc.url + "/echo", content=b"abc")
        assert r.content == b"abc"
        r = await c.get(sc.url + "/s")
        assert r.content == chunk(0) + b": preempted\n\n: resumed\n\n" + chunk(1)
        conn = await RawConn.open(sc.url)
        try:
            await conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nz")
            await conn.read_until(b"z")
        finally:
            await conn.close()
        names = {n.lower() for n, _ in fake.requests[-1].headers}
        assert b"accept-encoding" not in names
        assert b"user-agent" not in names
        assert len(fake.conns) < len(fake.requests)  # upstream connections were reused


def test_json_error_shape() -> None:
    from sidecar.proxy.downstream import error_body

    assert json.loads(json.dumps(error_body(502, "x")))["error"]["type"] == "unavailable_error"

"""What already held before the sidecar was hardened against hostile input, pinned down so
that it stays held.

Request smuggling (each variant hides a second request, ``/smuggled``, that must never
reach upstream), API-key bypass attempts, header floods, slowloris, and keepalive
comments that never land inside an event whatever the upstream's splits.
"""

from __future__ import annotations

import random
import re
import time

import anyio
import anyio.lowlevel
import pytest

from sidecar.proxy.server import Sidecar
from tests.hostile.test_listeners import drip_until_answered
from tests.support.fake_upstream import FakeUpstream, Script, chunk, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.rawclient import RawConn
from tests.support.samples import sample

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]

HIDDEN = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
_EOL = re.compile(rb"\r\n|\r|\n")

SMUGGLING: dict[str, tuple[bytes, int | tuple[int, ...]]] = {
    # name: (request bytes, the status the client gets, or the statuses of the requests
    # the bytes turn out to be; the connection then closes)
    "cl_te": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + HIDDEN, 400),
    "te_cl": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
              b"Content-Length: 60\r\n\r\n0\r\n\r\n" + HIDDEN, 400),
    "te_obfuscated_value": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n"
                            b"Content-Length: 5\r\n\r\n0\r\n\r\n" + HIDDEN, 501),
    "te_space_before_colon": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n"
                              b"\r\n0\r\n\r\n" + HIDDEN, 400),
    "te_list": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n"
                b"\r\n0\r\n\r\n" + HIDDEN, 501),
    "te_twice": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + HIDDEN, 501),
    "two_lengths": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                    b"Content-Length: 36\r\n\r\n" + HIDDEN, 400),
    "length_list": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0, 36\r\n\r\n" + HIDDEN,
                    400),
    "signed_length": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: +36\r\n\r\n" + HIDDEN,
                      400),
    # RFC 9112 section 5.2: a server rejects an obs-fold with 400 (or replaces it by a
    # space); the sidecar rejects it, so the folded "field" means nothing anywhere
    "folded_te": (b"POST /echo HTTP/1.1\r\nHost: x\r\nX-A: b\r\n Transfer-Encoding: chunked\r\n"
                  b"\r\n0\r\n\r\n" + HIDDEN, 400),
    "chunk_size_garbage": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"5x\r\nhello\r\n0\r\n\r\n" + HIDDEN, 400),
    "nul_in_header": (b"POST /echo HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n"
                      + HIDDEN, 400),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SMUGGLING))
async def test_smuggled_request_never_reaches_upstream(
    fake: FakeUpstream, sidecar: Sidecar, name: str
) -> None:
    data, statuses = SMUGGLING[name]
    async with await RawConn.open(sidecar.url) as c:
        await c.send(data)
        for status in statuses if isinstance(statuses, tuple) else (statuses,):
            resp = await c.read_response()
            assert resp.status == status, resp.body
        assert resp.header(b"connection") == b"close"
        assert await c.wait_closed() == b""
    assert all(r.target != b"/smuggled" for r in fake.requests)


async def test_hidden_request_in_a_valid_body_stays_a_body(
    fake: FakeUpstream, sidecar: Sidecar
) -> None:
    """Bytes that look like a request inside a counted body are body bytes."""
    body = b"x" * 4 + HIDDEN
    async with await RawConn.open(sidecar.url) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)  # fmt: skip
        resp = await c.read_response()
        assert resp.body == body
    assert [r.target for r in fake.requests] == [b"/echo"]


BYPASSES: dict[str, bytes] = {
    "no_key": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "wrong_key": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer kk\r\n\r\n",
    "key_prefix": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cre\r\n\r\n",
    "basic_scheme": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Basic czNjcmV0\r\n\r\n",
    "empty_bearer": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \r\n\r\n",
    "first_of_two_wrong": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer no\r\n"
                          b"Authorization: Bearer s3cret\r\n\r\n",
    "key_in_query": b"GET /v1/models?api_key=s3cret HTTP/1.1\r\nHost: x\r\n\r\n",
    "dot_segments": b"GET /health/../v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "encoded_slash": b"GET /health%2F..%2Fv1%2Fmodels HTTP/1.1\r\nHost: x\r\n\r\n",
    "double_slash": b"GET //health HTTP/1.1\r\nHost: x\r\n\r\n",
    "upper_case": b"GET /HEALTH HTTP/1.1\r\nHost: x\r\n\r\n",
    "trailing_slash": b"GET /health/ HTTP/1.1\r\nHost: x\r\n\r\n",
    "absolute_form": b"GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n",
    "asterisk": b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
    "semicolon": b"GET /health;/../v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
}  # fmt: skip


@pytest.mark.parametrize("name", list(BYPASSES))
async def test_api_key_bypass_attempts_get_401(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, name: str
) -> None:
    async with (
        sidecar_factory(fake.url, api_key="s3cret") as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(BYPASSES[name])
        assert (await c.read_response()).status == 401
    assert fake.conns == []


@pytest.mark.parametrize(
    "auth",
    [b"Authorization: Bearer s3cret", b"Authorization: bearer s3cret", b"X-Api-Key: s3cret"],
)
async def test_the_right_key_still_passes(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, auth: bytes
) -> None:
    async with (
        sidecar_factory(fake.url, api_key="s3cret") as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n\r\n")
        assert (await c.read_response()).status == 200


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /echo HTTP/1.1\r\nHost: x\r\n" + b"a:b\r\n" * 6000 + b"\r\n", 200),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\n" + b"a:b\r\n" * 7000 + b"\r\n", 431),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\nX: " + b"v" * 33_000 + b"\r\n\r\n", 431),
        (b"GET /" + b"p" * 33_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    ],
    ids=["6000-fields", "7000-fields", "one-long-field", "long-target"],
)
async def test_header_floods_are_bounded(
    fake: FakeUpstream, sidecar: Sidecar, head: bytes, status: int
) -> None:
    t0 = time.process_time()  # in memory: the client's, the sidecar's and upstream's work
    async with await RawConn.open(sidecar.url) as c:
        await c.send(head)
        assert (await c.read_response()).status == status
    assert time.process_time() - t0 < 1.0  # CPU, not wall time: the load around it is not ours


async def test_slowloris_head_gets_408_on_one_deadline(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    async with (
        sidecar_factory(fake.url, header_timeout=1.0) as sc,
        await RawConn.open(sc.url) as c,
    ):
        took, lines = await drip_until_answered(c, b"GET /echo HTTP/1.1\r\n", b"X-A: b\r\n", 0.2)
        assert took > 0.9
        assert lines <= 1.0 / 0.2 + 2  # one deadline for the head, not one per line
        assert (await c.read_response()).status == 408
    assert fake.conns == []


async def test_many_slowloris_connections_do_not_block_a_normal_client(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    """The normal client is answered while all 200 lorises are still held, at little cost.

    The lorises have a minute for their heads: a client served after them (or after any
    one of them) would wait that long.  The cost is CPU time, which the machine's load
    does not change.
    """
    async with sidecar_factory(fake.url, header_timeout=60.0) as sc:
        lorises = [await RawConn.open(sc.url) for _ in range(200)]
        try:
            for c in lorises:
                await c.send(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-A: ")
            t0 = time.process_time()
            async with await RawConn.open(sc.url) as c:
                await c.send(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await c.read_response(timeout=30)).status == 200
            assert time.process_time() - t0 < 0.5
            heard: list[bytes] = []

            async def listen(c: RawConn) -> None:
                with anyio.move_on_after(0.1):
                    try:
                        heard.append(await c.stream.receive())
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        heard.append(b"(closed)")

            async with anyio.create_task_group() as tg:
                for c in lorises:
                    tg.start_soon(listen, c)
            assert heard == []  # every loris still waits: no 408, no close
        finally:
            for c in lorises:
                await c.close()


def _random_split_script(seed: int) -> tuple[Script, bytes]:
    """Events (data, multi-line, event fields, CRLF, comments) cut at random offsets."""
    rng = random.Random(seed)
    events = [b": preempted\n\n"]
    for i in range(12):
        events.append(rng.choice([
            chunk(i), b"event: tok\ndata: %d\n\n" % i, b"data: a\r\ndata: b%d\r\n\r\n" % i,
            b"id: %d\rdata: cr\r\r" % i, b": other comment\n\n", b"data: " + b"z" * 300 + b"\n\n",
        ]))  # fmt: skip
    events.append(b": resumed\n\n")
    stream = b"".join(events)
    ends = {sum(len(e) for e in events[: i + 1]) for i in range(len(events) - 1)}
    cuts = sorted(set(rng.sample(range(1, len(stream)), 25)) | ends)
    script: Script = [sse_head()]
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        # pauses of half, one and a half and three keepalive intervals
        script += [("send", stream[a:b]), ("sleep", rng.choice([0.0, 0.0125, 0.0375, 0.075]))]
    return [*script, ("end",)], stream


def _strip_keepalives_at_boundaries(body: bytes) -> tuple[bytes, int]:
    """Remove sidecar keepalive blocks that start at an event boundary; count them.

    Lines end in CRLF, LF or a lone CR (WHATWG HTML 9.2.5); a blank line ends an event
    and a comment line leaves a boundary a boundary.
    """
    out, n, pos, boundary = [], 0, 0, True
    blocks = (b": preempt-keepalive\n\n", b": keepalive\n\n")
    while pos < len(body):
        block = next((b for b in blocks if body.startswith(b, pos)), None)
        if boundary and block is not None:
            pos += len(block)
            n += 1
            continue
        m = _EOL.search(body, pos)
        end = len(body) if m is None else m.end()
        line = body[pos:end]
        out.append(line)
        blank = m is not None and m.start() == pos
        boundary = blank or (boundary and line.startswith(b":"))
        pos = end
    return b"".join(out), n


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_keepalive_never_inside_an_event_under_random_splits(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, seed: int
) -> None:
    script, stream = _random_split_script(seed)
    fake.route("/v1/chat/completions", script)
    async with (
        sidecar_factory(fake.url, park_keepalive=0.025) as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await c.read_response(timeout=30)
    relayed, keepalives = _strip_keepalives_at_boundaries(resp.body)
    assert relayed == stream  # every other byte is upstream's, in order, untouched
    assert keepalives >= 3
    assert sample(sc, "keepalives_total", reason="park") == keepalives
    await anyio.lowlevel.checkpoint()

"""SSE relaying: notices unchanged, keepalives during parks, never inside an event, early open."""

from __future__ import annotations

import json

import pytest

from sidecar.proxy.server import Sidecar
from tests.support import sse_client
from tests.support.fake_upstream import SSE_HEADERS, FakeUpstream, chunk, park_script, sse_head
from tests.support.fixtures import SidecarFactory
from tests.support.memnet import http_client
from tests.support.rawclient import RawConn
from tests.support.samples import sample
from tests.support.sse_client import astream_sse

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]


async def timed_stream(url: str) -> tuple[int, dict[str, str], list[tuple[float, bytes]]]:
    """POST a streaming request; status, headers and the reads (the head first, as b"")."""
    log = await astream_sse(url, {"stream": True})
    assert log.error is None, log.error
    return log.status, log.headers, [(log.t_headers, b""), *log.reads]


def body_of(reads: list[tuple[float, bytes]]) -> bytes:
    return b"".join(d for _, d in reads)


def max_gap(reads: list[tuple[float, bytes]]) -> float:
    return sse_client.max_gap(t for t, _ in reads)


def without_keepalives(body: bytes) -> bytes:
    return body.replace(b": keepalive\n\n", b"").replace(b": preempt-keepalive\n\n", b"")


async def test_notices_pass_through_unchanged(fake: FakeUpstream, sidecar: Sidecar) -> None:
    notices = [b": preempted\n\n", b": preempt-keepalive\n\n", b": resumed\n\n",
               b": preempted 1\n\n", b": recomputed 1\n\n", b":\n\n",
               b": something else\r\n\r\n"]  # fmt: skip
    script = [sse_head(), ("send", chunk(0))]
    for n in notices:
        script += [("send", n), ("send", chunk(1))]
    fake.route("/v1/chat/completions", [*script, ("end",)])
    status, headers, reads = await timed_stream(sidecar.url + "/v1/chat/completions")
    assert status == 200
    assert headers["content-type"] == "text/event-stream"
    assert headers["x-accel-buffering"] == "no"
    assert headers["cache-control"] == "no-cache"
    expected = chunk(0) + b"".join(n + chunk(1) for n in notices)
    assert body_of(reads) == expected


async def test_long_park_gap_bounded(fake: FakeUpstream, sidecar_factory: SidecarFactory) -> None:
    # a park six park-keepalive intervals long (the interval scaled down from the default 1 s)
    fake.route("/v1/chat/completions", park_script(before=3, park=2.4, after=3))
    async with sidecar_factory(fake.url, park_keepalive=0.4) as sc:
        status, _, reads = await timed_stream(sc.url + "/v1/chat/completions")
    assert status == 200
    body = body_of(reads)
    assert without_keepalives(body) == b"".join(
        [chunk(0), chunk(1), chunk(2), b": preempted\n\n", b": resumed\n\n",
         chunk(3), chunk(4), chunk(5), b"data: [DONE]\n\n"]
    )  # fmt: skip
    assert body.count(b": preempt-keepalive\n\n") >= 5
    assert b": keepalive\n\n" not in body
    # the client never waits longer than the park keepalive + 0.1 s
    assert max_gap(reads) <= 0.4 + 0.1


async def test_idle_keepalive(fake: FakeUpstream, sidecar_factory: SidecarFactory) -> None:
    # keepalives are due at 90% of the interval: 0.45 s and 0.9 s, the next at 1.35 s
    fake.route("/s", [sse_head(), ("send", chunk(0)), ("sleep", 1.2), ("send", chunk(1)), ("end",)])
    async with sidecar_factory(fake.url, idle_keepalive=0.5) as sc:
        _, _, reads = await timed_stream(sc.url + "/s")
    body = body_of(reads)
    assert body == chunk(0) + b": keepalive\n\n: keepalive\n\n" + chunk(1)


async def test_upstream_keepalives_count_as_liveness(fake: FakeUpstream, sidecar: Sidecar) -> None:
    fake.route("/s", park_script(before=1, park=1.25, after=1, upstream_keepalive=0.2))
    _, _, reads = await timed_stream(sidecar.url + "/s")
    body = body_of(reads)
    # upstream sent a preempt-keepalive every 0.2 s (the sidecar's interval is 1 s): it adds none
    assert body.count(b": preempt-keepalive\n\n") == 6


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"data: part one\n", b"data: part two\n\n"),  # stall between the lines of an event
        (b"data: part o", b"ne\n\n"),  # stall inside a line
        (b"data: part one\r", b"\n\r\n"),  # stall after a \r of a \r\n
        (b"event: x\r\n", b"data: y\r\n\r\n"),
    ],
    ids=["between-lines", "mid-line", "split-crlf", "event-field"],
)
async def test_never_inside_an_event(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, first: bytes, second: bytes
) -> None:
    fake.route("/s", [sse_head(), ("send", chunk(0)), ("send", b": preempted\n\n"), ("sleep", 0.4),
                      ("send", first), ("sleep", 0.6), ("send", second),
                      ("sleep", 0.4), ("send", b": resumed\n\n"), ("end",)])  # fmt: skip
    async with sidecar_factory(fake.url, park_keepalive=0.15, idle_keepalive=0.15) as sc:
        _, _, reads = await timed_stream(sc.url + "/s")
    body = body_of(reads)
    event = first + second
    # the event arrives contiguous: no comment was written between its bytes
    assert event in body
    # keepalives flowed before and after it
    before, after = body.split(event)
    assert before.count(b": preempt-keepalive\n\n") >= 1
    assert after.count(b": preempt-keepalive\n\n") >= 1


async def test_silence_after_a_stalled_event_is_bounded(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/s", [sse_head(), ("send", b": preempted\n\ndata: half"), ("sleep", 0.5),
                      ("send", b"\n\n"), ("sleep", 0.5), ("send", b": resumed\n\n"),
                      ("end",)])  # fmt: skip
    async with sidecar_factory(fake.url, park_keepalive=0.15) as sc:
        _, _, reads = await timed_stream(sc.url + "/s")
    end = next(i for i, (_, d) in enumerate(reads) if d.endswith(b"half\n\n") or d == b"\n\n")
    # the stall inside the event cannot be filled; after it, the bound holds again
    assert max_gap(reads[end:]) <= 0.15 + 0.1
    assert body_of(reads[end:]).count(b": preempt-keepalive\n\n") >= 2


async def test_early_open_keeps_alive_then_streams(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/v1/chat/completions", [("sleep", 0.6), sse_head(), ("send", chunk(0)), ("end",)])
    async with sidecar_factory(fake.url, early_open_after=0.15, idle_keepalive=0.15) as sc:
        status, headers, reads = await timed_stream(sc.url + "/v1/chat/completions")
    assert status == 200
    assert headers["content-type"] == "text/event-stream"
    assert reads[0][0] - reads[0][0] == 0
    body = body_of(reads)
    assert body.endswith(chunk(0))
    assert body.count(b": keepalive\n\n") >= 2
    assert max_gap(reads) < 0.15 + 0.15 + 0.2


async def test_early_open_turns_upstream_4xx_into_error_event(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    err = {
        "error": {
            "code": 400,
            "message": "the request exceeds the context",
            "type": "invalid_request_error",
        }
    }
    payload = json.dumps(err).encode()
    fake.route("/v1/chat/completions", [("sleep", 0.5),
               ("head", 400, [(b"Content-Type", b"application/json"),
                              (b"Content-Length", str(len(payload)).encode())]),
               ("send", payload), ("end",)])  # fmt: skip
    async with sidecar_factory(fake.url, early_open_after=0.1, idle_keepalive=0.15) as sc:
        status, _, reads = await timed_stream(sc.url + "/v1/chat/completions")
    assert status == 200
    body = without_keepalives(body_of(reads))
    assert body.startswith(b"data: ")
    assert body.endswith(b"\n\n")
    assert body.count(b"data: ") == 1
    assert json.loads(body[6:]) == err


async def test_early_open_off_for_non_streaming(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/x", [("sleep", 0.3), ("head", 404, [(b"Content-Length", b"0")]), ("end",)])
    async with sidecar_factory(fake.url, early_open_after=0.1) as sc, http_client() as c:
        r = await c.post(sc.url + "/x", json={"stream": False})
    assert r.status_code == 404


async def test_early_open_upstream_down(
    sidecar_factory: SidecarFactory, fake: FakeUpstream
) -> None:
    # connect fails fast: a plain 502 (nothing was opened yet)
    async with (
        sidecar_factory("http://127.0.0.1:1", early_open_after=0.2) as sc,
        http_client() as c,
    ):
        r = await c.post(sc.url + "/v1/chat/completions", json={"stream": True})
    assert r.status_code == 502


async def test_comment_split_notices_still_counted(fake: FakeUpstream, sidecar: Sidecar) -> None:
    fake.route("/s", [sse_head(), ("send", b": pree"), ("send", b"mpted\r"), ("send", b"\n\r\n"),
                      ("send", b": resumed\n\n"), ("end",)])  # fmt: skip
    conn = await RawConn.open(sidecar.url)
    try:
        await conn.send(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
        await conn.read_until(b"0\r\n\r\n")
    finally:
        await conn.close()
    assert sample(sidecar, "parks_total") == 1
    assert sample(sidecar, "resumes_total") == 1


def test_sse_headers_constant() -> None:
    assert (b"Content-Type", b"text/event-stream") in SSE_HEADERS

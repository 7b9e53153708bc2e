"""Finding 7: a deadline on the upstream response head, and a cap on interim responses.

An upstream that never answered, dripped its header lines, or looped on ``100 Continue``
left the client waiting for ever (and a flood of 1xx cost CPU).  Now the head has
``upstream_head_timeout`` seconds from the moment the request is sent (504), and more
than ``MAX_INTERIM`` interim responses are a protocol error (502).  Either way the
upstream connection is closed, never pooled.
"""

from __future__ import annotations

import time

import anyio
import pytest

from sidecar.proxy.server import Sidecar
from sidecar.proxy.upstream import MAX_HEAD, MAX_HEADERS, MAX_INTERIM
from tests.support.fake_upstream import FakeUpstream, Script
from tests.support.fixtures import SidecarFactory
from tests.support.rawclient import RawConn
from tests.support.samples import sample

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]

HEAD_TIMEOUT = 0.25
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# a line every fifth of the deadline, for ten seconds: far past read_response's 5 s, so a
# head without a deadline, or with one per line, fails the test
DRIP: Script = [
    ("raw", b"HTTP/1.1 200 OK\r\n"),
    *[x for _ in range(200) for x in (("sleep", 0.05), ("raw", b"X-Drip: 1\r\n"))],
]
SLOW_CONTINUES: Script = [x for _ in range(200) for x in (("raw", CONTINUE), ("sleep", 0.05))]
CASES: dict[str, tuple[Script, int]] = {
    "never_answers": ([("hang",)], 504),
    "drips_header_lines": (DRIP, 504),
    "continue_flood": ([("raw", CONTINUE * 10_000), ("hang",)], 502),
    "slow_continue_loop": (SLOW_CONTINUES, 504),  # the deadline covers interim responses
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
async def test_upstream_head_has_a_deadline(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, case: str
) -> None:
    script, status = CASES[case]
    fake.route("/slow", script)
    async with sidecar_factory(fake.url, upstream_head_timeout=HEAD_TIMEOUT) as sc:
        async with await RawConn.open(sc.url) as c:
            t0 = time.monotonic()
            await c.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            resp = await c.read_response(timeout=5)
            took = time.monotonic() - t0
            assert resp.status == status, resp.body
            assert resp.reason
            if status == 504:
                assert took >= HEAD_TIMEOUT
        with anyio.fail_after(2):
            await fake.conns[-1].closed.wait()  # closed, not pooled
        kind = "timeout" if status == 504 else "protocol"
        assert sample(sc, "upstream_errors_total", kind=kind) == 1


async def test_a_few_interim_responses_are_fine(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/ok", [("raw", CONTINUE * MAX_INTERIM + b"HTTP/1.1 200 OK\r\n"
                                                      b"Content-Length: 2\r\n\r\nok")])  # fmt: skip
    async with sidecar_factory(fake.url) as sc, await RawConn.open(sc.url) as c:
        await c.send(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await c.read_response()
        assert (resp.status, resp.body) == (200, b"ok")


async def test_a_slow_head_within_the_deadline_is_relayed(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    """The deadline is for the head only: a long stream after it is not cut."""
    fake.route("/v1/chat/completions", [
        ("sleep", 0.05), ("raw", b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n"),
        *[x for i in range(8) for x in (("sleep", 0.1), ("raw", b"a\r\ndata: %d\n\n\r\n" % i))],
        ("raw", b"0\r\n\r\n")])  # fmt: skip
    async with (
        sidecar_factory(fake.url, upstream_head_timeout=HEAD_TIMEOUT) as sc,
        await RawConn.open(sc.url) as c,
    ):
        await c.send(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await c.read_response(timeout=5)
        assert resp.status == 200
        assert resp.body.count(b"data: ") == 8


PAD = 80 * 1024  # one header line's value
BIG_HEAD_START = b"HTTP/1.1 200 OK\r\n" + b"".join(
    b"X-Pad-%d: %s\r\n" % (i, b"a" * PAD) for i in range(3)
)  # 240 KiB: under the cap, and incomplete
BIG_HEAD_END = b"X-Pad-3: " + b"a" * (60 * 1024) + b"\r\nContent-Length: 2\r\n\r\nok"


async def test_a_head_over_the_cap_is_a_502_whatever_the_read_sizes(
    fake: FakeUpstream, sidecar: Sidecar
) -> None:
    """The cap is on the whole head: one that is completed by its last read is over it too.

    h11 limits a head only while it is incomplete: 240 KiB, then 60 KiB with the end of
    the head in one read, made a 300 KiB head that was relayed.
    """
    assert len(BIG_HEAD_START) + len(BIG_HEAD_END) > MAX_HEAD > len(BIG_HEAD_START)
    fake.route("/big", [("raw", BIG_HEAD_START), ("sleep", 0.3), ("raw", BIG_HEAD_END)])
    async with await RawConn.open(sidecar.url) as c:
        await c.send(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await c.read_response(timeout=5)
        assert resp.status == 502, resp.raw_head[:200]
        assert b"head over" in resp.body
    assert sample(sidecar, "upstream_errors_total", kind="protocol") == 1


@pytest.mark.parametrize(("fields", "status"), [(MAX_HEADERS, 200), (MAX_HEADERS + 1, 502),
                                                (20_000, 502)])  # fmt: skip
async def test_a_head_with_too_many_fields_is_a_502(
    fake: FakeUpstream, sidecar: Sidecar, fields: int, status: int
) -> None:
    """20,000 short header fields fit in 256 KiB; they were relayed (nginx: 502)."""
    lines = b"Content-Length: 2\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(fields - 1))
    fake.route("/many", [("raw", b"HTTP/1.1 200 OK\r\n" + lines + b"\r\nok")])
    async with await RawConn.open(sidecar.url) as c:
        await c.send(b"GET /many HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await c.read_response(timeout=5)
        assert resp.status == status
        if status == 200:
            assert resp.body == b"ok"
        else:
            assert b"header fields" in resp.body

"""A body the priority rule reads must be text llama-server parses: else a clean 400.

With a rule on, a ``\\ud800`` escape or CESU-8 surrogate bytes (``ED A0 80``) in a
completion body got a 500 and a traceback from the sidecar (Python's JSON round trip
could not encode the lone surrogate), and the body's temporary file stayed open until
garbage collection.  llama-server itself answers such a body with a 500 (its JSON parser
refuses both).  Now the sidecar refuses it with a 400 that says why, closes the file at
once, and forwards nothing.  Paired surrogate escapes (an emoji as ``\\ud83d\\ude00``) and
escaped backslashes before a ``u`` are text and go through, whatever the split of the body
into pieces (:class:`~sidecar.jsontext.TextCheck` is fed piece by piece).
"""

from __future__ import annotations

import json
import logging
import random

import anyio
import pytest

from sidecar.jsontext import BadText, TextCheck
from tests.hostile.test_body_spool import open_temp_files
from tests.support.fake_upstream import FakeUpstream
from tests.support.fixtures import SidecarFactory
from tests.support.rawclient import RawConn

BAD = {
    "lone_high_escape": b'{"prompt":"a\\ud800b","n_predict":1}',
    "lone_low_escape": b'{"prompt":"\\udc00","n_predict":1}',
    "high_then_high": b'{"prompt":"\\ud83d\\ud83d","n_predict":1}',
    "cesu8_bytes": b'{"prompt":"\xed\xa0\x80","n_predict":1}',
    "cesu8_pair": b'{"prompt":"\xed\xa0\xbd\xed\xb8\x80","n_predict":1}',
    "latin1_byte": b'{"prompt":"caf\xe9","n_predict":1}',
}
GOOD = {
    "emoji_escaped": b'{"prompt":"\\ud83d\\ude00","n_predict":1}',
    "emoji_utf8": '{"prompt":"😀 é","n_predict":1}'.encode(),
    "escaped_backslash_u": b'{"prompt":"\\\\ud800","n_predict":1}',
    "three_backslashes_pair": b'{"prompt":"\\\\\\ud83d\\ude00","n_predict":1}',
}


def check(body: bytes, piece: int) -> str | None:
    c = TextCheck()
    try:
        for i in range(0, len(body), piece):
            c.feed(body[i : i + piece])
        c.finish()
    except BadText as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", list(BAD))
def test_bad_text_is_found_whatever_the_split(name: str) -> None:
    for piece in (1, 2, 3, 5, 7, 11, 13, 64, 1 << 20):
        assert check(BAD[name], piece) is not None, piece


@pytest.mark.parametrize("name", list(GOOD))
def test_good_text_passes_whatever_the_split(name: str) -> None:
    for piece in (1, 2, 3, 5, 7, 11, 13, 64, 1 << 20):
        assert check(GOOD[name], piece) is None, piece


def test_json_dumps_output_always_passes_and_a_lone_surrogate_never() -> None:
    """Property: whatever Python's JSON writer makes of real text passes, cut anywhere."""
    rng = random.Random(7)
    alphabet = ["a", "\\", '"', "u", "\n", "é", "😀", "\U00010348", "\\u", "ud800"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        for ascii_only in (True, False):
            body = json.dumps({"prompt": text}, ensure_ascii=ascii_only).encode()
            assert check(body, rng.randrange(1, 20)) is None, body
            lone = json.dumps({"prompt": text + "\ud800" + text}).encode()  # always escaped
            assert check(lone, rng.randrange(1, 20)) is not None, lone


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(BAD))
async def test_bad_text_gets_a_400_and_its_file_is_closed_at_once(
    fake: FakeUpstream,
    sidecar_factory: SidecarFactory,
    caplog: pytest.LogCaptureFixture,
    name: str,
) -> None:
    body = BAD[name] + b" " * (2 * 1024 * 1024)  # past --body-buffer: a temporary file
    caplog.set_level(logging.INFO)
    async with sidecar_factory(fake.url, priority_default=5) as sc:
        files = open_temp_files()
        async with await RawConn.open(sc.url) as c:
            await c.send(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)  # fmt: skip
            resp = await c.read_response()
            assert resp.status == 400, resp.body
            assert b"surrogate" in resp.body or b"UTF-8" in resp.body
            # no garbage collection needed: the file is closed when the answer is sent
            assert open_temp_files() <= files
        with anyio.fail_after(5):
            while sc.ctx.active:
                await anyio.sleep(0.01)
    assert fake.requests == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(GOOD))
async def test_good_text_is_forwarded_with_the_priority(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, name: str
) -> None:
    async with (
        sidecar_factory(fake.url, priority_default=5) as sc,
        await RawConn.open(sc.url) as c,
    ):
        body = GOOD[name]
        await c.send(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)  # fmt: skip
        resp = await c.read_response()
        assert resp.status == 200
    assert json.loads(fake.requests[0].body)["priority"] == 5

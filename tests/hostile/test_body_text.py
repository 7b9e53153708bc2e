"""A body the priority rule reads must be text llama-server parses: else a clean 400.

With a rule on, a ``\\ud800`` escape or CESU-8 surrogate bytes (``ED A0 80``) in a
completion body got a 500 and a traceback from the sidecar (Python's JSON round trip
could not encode the lone surrogate), and the body's temporary file stayed open until
garbage collection.  llama-server itself answers such a body with a 500 (its JSON parser
refuses both).  Now the sidecar refuses it with a 400 that says why, closes the file at
once, and forwards nothing.  Paired surrogate escapes (an emoji as ``\\ud83d\\ude00``) and
escaped backslashes before a ``u`` are text and go through, whatever the split of the body
into pieces (:class:`~sidecar.core.jsontext.TextCheck` is fed piece by piece).
"""

from __future__ import annotations

import json
import logging
import random

import anyio
import pytest

from sidecar.core.jsontext import BadText, TextCheck
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


def reference(body: bytes) -> bool:
    """An independent reading: True if the body is UTF-8 and every surrogate escape is paired.

    Walks the escapes one by one, as a JSON string parser does.
    """
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    i, pending_high = 0, False
    while i < len(body):
        if body[i] == ord("\\"):
            if body[i + 1 : i + 2] == b"u" and i + 6 <= len(body):
                try:
                    code = int(body[i + 2 : i + 6], 16)
                except ValueError:
                    code = -1
                if 0xD800 <= code <= 0xDBFF and not pending_high:
                    pending_high, i = True, i + 6
                    continue
                if 0xDC00 <= code <= 0xDFFF and pending_high:
                    pending_high, i = False, i + 6
                    continue
                if 0xD800 <= code <= 0xDFFF:
                    return False
            if pending_high:
                return False
            i += 2
            continue
        if pending_high:
            return False
        i += 1
    return not pending_high


def test_the_check_agrees_with_a_reading_escape_by_escape() -> None:
    """Property: random bodies made of escape fragments, cut into pieces of any size."""
    rng = random.Random(1)
    parts = [b"\\", b"u", b"d", b"8", b"3", b"D", b"c", b"e", b"0", b"a", b"x", b'"',
             b"\\ud83d", b"\\ude00", b"\\ud800", b"\\udc00", b"\\\\"]  # fmt: skip
    for _ in range(3000):
        body = b"".join(rng.choice(parts) for _ in range(rng.randrange(1, 30)))
        want = None if reference(body) else "bad"
        for piece in (1, 2, 3, 7, 64):
            got = check(body, piece)
            assert (got and "bad") == want, (body, piece, got)


def test_what_is_kept_between_pieces_is_bounded() -> None:
    """A megabyte run of backslashes is kept as its parity, not re-read with every piece."""
    c = TextCheck()
    c.feed(b'{"a":"')
    for _ in range(256):
        c.feed(b"\\" * 4096)
        assert len(c._carry) <= 32
    c.feed(b"\\ud800")  # an odd run in all: a real escape, and alone
    with pytest.raises(BadText, match="unpaired"):
        c.finish()


@pytest.mark.anyio
@pytest.mark.in_memory
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
@pytest.mark.in_memory
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

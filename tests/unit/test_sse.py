"""SSE scanner: table-driven cases and the any-split property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core.sse import Blank, Comment, Field, Line, SSEScanner

B = Blank()


def scan(chunks: list[bytes]) -> tuple[list[Line], bool]:
    s = SSEScanner()
    out: list[Line] = []
    for c in chunks:
        out.extend(s.feed(c))
    return out, s.at_boundary


CASES: list[tuple[bytes, list[Line], bool]] = [
    (b"", [], True),
    (b"data: x\n\n", [Field(b"data", b"x"), B], True),
    (b"data: x\r\n\r\n", [Field(b"data", b"x"), B], True),
    (b"data: x\r\r", [Field(b"data", b"x"), B], True),
    (b"data: x\n", [Field(b"data", b"x")], False),
    (b"data: x", [], False),
    (b": preempted\n\n", [Comment(b" preempted"), B], True),
    (b": preempted\n", [Comment(b" preempted")], True),
    (b":\n\n", [Comment(b""), B], True),
    (b"data:x\n", [Field(b"data", b"x")], False),
    (b"data:  two\n", [Field(b"data", b" two")], False),
    (b"data\n\n", [Field(b"data", b""), B], True),
    (b"event: a\ndata: 1\n\n", [Field(b"event", b"a"), Field(b"data", b"1"), B], True),
    (b"\r\n\n\r", [B, B, B], True),
    (b"data: a\r", [Field(b"data", b"a")], False),
    (b": c", [], False),
]


@pytest.mark.parametrize(("stream", "lines", "boundary"), CASES)
def test_table(stream: bytes, lines: list[Line], boundary: bool) -> None:
    assert scan([stream]) == (lines, boundary)


def test_crlf_split_across_reads() -> None:
    s = SSEScanner()
    assert s.feed(b"data: a\r") == [Field(b"data", b"a")]
    assert s.feed(b"\n") == []  # the \n of the split \r\n, not a blank line
    assert not s.at_boundary
    assert s.feed(b"\r") == [B]
    assert s.at_boundary
    assert s.feed(b"") == []
    assert s.feed(b"\n: x\n") == [Comment(b" x")]


def test_complete_crlf_at_chunk_end_does_not_swallow_next_lf() -> None:
    s = SSEScanner()
    assert s.feed(b"event: x\r\n\r\n") == [Field(b"event", b"x"), B]
    assert s.feed(b"\n") == [B]  # a new (empty) line, not the tail of the \r\n


def test_trailing_cr_is_a_line_end() -> None:
    s = SSEScanner()
    s.feed(b"data: a\n\r")
    assert s.at_boundary  # the blank line is complete at the \r already


def test_comment_inside_event_keeps_event_open() -> None:
    lines, boundary = scan([b"data: a\n: preempted\n"])
    assert lines == [Field(b"data", b"a"), Comment(b" preempted")]
    assert not boundary


# A realistic stream: llama-server chunks with notices, mixed line endings.
_NO_EOL = st.binary(max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b)
_LINE = st.one_of(
    st.builds(lambda v: b"data: " + v, _NO_EOL),
    st.sampled_from(
        [b": preempted", b": resumed 1", b":", b"event: x", b"", b"id: 7", b"retry: 10", b"data"]
    ),
)
_EOLS = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(st.tuples(_LINE, _EOLS), max_size=25))
    return b"".join(line + eol for line, eol in lines)


@st.composite
def splits(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    data = draw(streams())
    cuts = sorted(draw(st.sets(st.integers(0, len(data)), max_size=12)))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return data, chunks


@settings(max_examples=300, deadline=None)
@given(splits())
def test_any_split_gives_same_lines(case: tuple[bytes, list[bytes]]) -> None:
    data, chunks = case
    assert scan(chunks) == scan([data])


@settings(max_examples=100, deadline=None)
@given(streams())
def test_byte_by_byte(data: bytes) -> None:
    assert scan([data[i : i + 1] for i in range(len(data))]) == scan([data])


@settings(max_examples=300, deadline=None)
@given(splits(), st.lists(st.booleans(), max_size=12))
def test_feed_comments_matches_feed(case: tuple[bytes, list[bytes]], fast: list[bool]) -> None:
    """The fast path gives the same comments and boundary state, even when mixed."""
    _, chunks = case
    ref, s = SSEScanner(), SSEScanner()
    for i, c in enumerate(chunks):
        expected = [x.text for x in ref.feed(c) if isinstance(x, Comment)]
        if i < len(fast) and not fast[i]:
            got = [x.text for x in s.feed(c) if isinstance(x, Comment)]
        else:
            got = s.feed_comments(c)
        assert got == expected
        assert s.at_boundary == ref.at_boundary
        assert s.in_event == ref.in_event


@settings(max_examples=200, deadline=None)
@given(splits())
def test_boundary_matches_prefix_rescan(case: tuple[bytes, list[bytes]]) -> None:
    """at_boundary after each chunk equals at_boundary of scanning that prefix whole."""
    _, chunks = case
    s = SSEScanner()
    seen = b""
    for c in chunks:
        s.feed(c)
        seen += c
        assert s.at_boundary == scan([seen])[1]


@pytest.mark.parametrize(
    ("chunks", "comments", "at_boundary"),
    [
        ([b"data: x\n\n"], [], True),  # whole event, no comment: decided without a split
        ([b"data: x\n\ndata: y\n\n"], [], True),
        ([b": preempted\n\n"], [b" preempted"], True),
        ([b"data: x\n\n: resumed\n\n"], [b" resumed"], True),
        ([b"data: x\n", b"\n"], [], True),  # the pending partial line joins the next read
        ([b":", b" c\n\n"], [b" c"], True),
        ([b"data: x\n\ndata: y\n"], [], False),
    ],
)
def test_feed_comments_table(chunks: list[bytes], comments: list[bytes], at_boundary: bool) -> None:
    s = SSEScanner()
    got = [text for c in chunks for text in s.feed_comments(c)]
    assert (got, s.at_boundary) == (comments, at_boundary)

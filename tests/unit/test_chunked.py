"""Chunked decoder: table cases and the any-split property against h11's encoder."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core.chunked import ChunkedDecoder, ChunkedError, whole_chunks


def decode(chunks: list[bytes]) -> tuple[bytes, bool, bytes]:
    d = ChunkedDecoder()
    out = b"".join(d.feed(c) for c in chunks)
    return out, d.done, d.leftover


@pytest.mark.parametrize(
    ("wire", "body"),
    [
        (b"0\r\n\r\n", b""),
        (b"5\r\nhello\r\n0\r\n\r\n", b"hello"),
        (b"5;ext=1\r\nhello\r\n0\r\n\r\n", b"hello"),
        (b"A\r\n0123456789\r\n0\r\nX-T: 1\r\n\r\n", b"0123456789"),
        (b"5\nhello\n0\n\n", b"hello"),
        (b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", b"abcde"),
    ],
)
def test_table(wire: bytes, body: bytes) -> None:
    assert decode([wire]) == (body, True, b"")


def test_leftover_after_end() -> None:
    assert decode([b"1\r\nx\r\n0\r\n\r\nHTTP/1.1"]) == (b"x", True, b"HTTP/1.1")


def test_incomplete() -> None:
    out, done, _ = decode([b"5\r\nhel"])
    assert (out, done) == (b"hel", False)


@pytest.mark.parametrize("wire", [b"zz\r\n", b"5\r\nhelloXX0\r\n\r\n", b"1" * 5000])
def test_errors(wire: bytes) -> None:
    with pytest.raises(ChunkedError):
        decode([wire])


def h11_encode(parts: list[bytes]) -> bytes:
    c = h11.Connection(h11.SERVER)
    c.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    c.next_event()
    c.next_event()
    out = c.send(h11.Response(status_code=200, headers=[(b"Transfer-Encoding", b"chunked")]))
    head_len = len(out or b"")
    for p in parts:
        out = (out or b"") + (c.send(h11.Data(data=p)) or b"")
    out = (out or b"") + (c.send(h11.EndOfMessage()) or b"")
    return out[head_len:]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), max_size=12), st.data())
def test_any_split(parts: list[bytes], data: st.DataObject) -> None:
    wire = h11_encode(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(wire)), max_size=10)))
    chunks = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    assert decode(chunks) == (b"".join(parts), True, b"")


def test_byte_by_byte() -> None:
    wire = h11_encode([b"data: x\n\n", b": preempted\n\n"])
    assert decode([wire[i : i + 1] for i in range(len(wire))]) == (
        b"data: x\n\n: preempted\n\n",
        True,
        b"",
    )


# ------------------------------------------------------------ pass-through


@pytest.mark.parametrize(
    ("wire", "payload", "used"),
    [
        (b"5\r\nhello\r\n", b"hello", 10),
        (b"5\r\nhello\r\n3\r\nabc\r\n", b"helloabc", 18),
        (b"A\r\n0123456789\r\n", b"0123456789", 15),
        (b"5\r\nhello\r\n0\r\n\r\n", b"hello", 10),  # the last-chunk is left to the decoder
        (b"5\r\nhello\r\n3\r\nab", b"hello", 10),  # so is a partial chunk
        (b"5\r\nhel", b"", 0),
        (b"5;ext=1\r\nhello\r\n", b"", 0),  # extensions: not canonical
        (b"5\nhello\n", b"", 0),  # bare LF: not canonical
        (b"5\r\nhelloXX", b"", 0),
        (b"0\r\n\r\n", b"", 0),
        (b"", b"", 0),
    ],
)
def test_whole_chunks_table(wire: bytes, payload: bytes, used: int) -> None:
    assert whole_chunks(wire) == (payload, used)


def relay_reads(reads: list[bytes]) -> tuple[bytes, bytes, bool]:
    """What the relay's sink does: whole chunks forwarded, the rest decoded."""
    d = ChunkedDecoder()
    body, wire = b"", b""
    for data in reads:
        if d.idle:
            out, used = whole_chunks(data)
            assert ChunkedDecoder().feed(data[:used]) == out
            wire += data[:used]
            tail = d.feed(data[used:])
            body += out + tail
            wire += b"%x\r\n%b\r\n" % (len(tail), tail) if tail else b""
        else:
            out = d.feed(data)
            body += out
            wire += b"%x\r\n%b\r\n" % (len(out), out) if out else b""
    return body, wire, d.done


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), max_size=12), st.data())
def test_pass_through_any_split(parts: list[bytes], data: st.DataObject) -> None:
    """Any split: same body as the decoder, and what is forwarded is valid framing of it."""
    wire = h11_encode(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(wire)), max_size=10)))
    reads = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    body, forwarded, done = relay_reads(reads)
    assert (body, done) == (b"".join(parts), True)
    assert decode([forwarded + b"0\r\n\r\n"]) == (body, True, b"")


def test_pass_through_keeps_upstream_bytes() -> None:
    wire = h11_encode([b"data: a\n\n", b": preempted\n\n"])
    body, forwarded, done = relay_reads([wire])
    assert forwarded == wire[: -len(b"0\r\n\r\n")]
    assert (body, done) == (b"data: a\n\n: preempted\n\n", True)

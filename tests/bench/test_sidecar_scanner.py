"""pytest-benchmark figures for the sidecar's pure hot path on a realistic stream.

Run: ``pytest tests/bench --benchmark-enable``.  (With the default
``--benchmark-disable`` each runs once, as a test.)  The stream: 2,000
llama-server chat chunks (~230 bytes each) with a park every 100 tokens
(``: preempted``, three ``: preempt-keepalive``, ``: resumed``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.core.chunked import ChunkedDecoder, whole_chunks
from sidecar.core.notices import classify
from sidecar.core.sse import SSEScanner


def _event(i: int) -> bytes:
    payload = {
        "choices": [{"finish_reason": None, "index": 0, "delta": {"content": f" token{i}"}}],
        "created": 1700000000,
        "id": "chatcmpl-QJ4m2c1yq7oWbTn0xq8e5rQk3fJ2",
        "model": "gemma-3-270m-it-Q4_K_M",
        "system_fingerprint": "b6000-abcdef12",
        "object": "chat.completion.chunk",
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _writes() -> list[bytes]:
    out: list[bytes] = []
    for i in range(2000):
        if i % 100 == 50:
            out += [b": preempted\n\n"] + [b": preempt-keepalive\n\n"] * 3 + [b": resumed\n\n"]
        out.append(_event(i))
    out.append(b"data: [DONE]\n\n")
    return out


WRITES = _writes()  # one element per upstream write (one token each)
STREAM = b"".join(WRITES)
READS = [STREAM[i : i + 65536] for i in range(0, len(STREAM), 65536)]  # a fast upstream
EVENTS = len(WRITES)


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def _scan_full(chunks: list[bytes]) -> int:
    s = SSEScanner()
    return sum(len(s.feed(c)) for c in chunks)


def _scan_comments(chunks: list[bytes]) -> int:
    s = SSEScanner()
    n = 0
    for c in chunks:
        for text in s.feed_comments(c):
            classify(text)
            n += 1
    return n


def _decode(chunks: list[bytes]) -> int:
    d = ChunkedDecoder()
    return sum(len(d.feed(c)) for c in chunks)


def test_scanner_feed_per_token(benchmark: Any) -> None:
    assert benchmark(_scan_full, WRITES) > EVENTS


def test_scanner_comments_per_token(benchmark: Any) -> None:
    assert benchmark(_scan_comments, WRITES) == 20 * 5


def test_scanner_comments_64k_reads(benchmark: Any) -> None:
    assert benchmark(_scan_comments, READS) == 20 * 5


def test_scanner_crlf_stream(benchmark: Any) -> None:
    crlf = [w.replace(b"\n", b"\r\n") for w in WRITES]
    assert benchmark(_scan_comments, crlf) == 20 * 5


def test_chunked_decoder_64k_reads(benchmark: Any) -> None:
    wire = _chunked(WRITES)
    reads = [wire[i : i + 65536] for i in range(0, len(wire), 65536)]
    assert benchmark(_decode, reads) == len(STREAM)


@pytest.mark.parametrize("text", [b" preempted 1", b" hello", b""])
def test_classify(benchmark: Any, text: bytes) -> None:
    benchmark(classify, text)


def _decode_reframe(chunks: list[bytes]) -> int:
    """The relay before pass-through: decode each read, frame it again."""
    d = ChunkedDecoder()
    n = 0
    for c in chunks:
        out = d.feed(c)
        if out:
            n += len(b"%x\r\n%b\r\n" % (len(out), out))
    return n


def _pass_through(chunks: list[bytes]) -> int:
    """The relay's pass-through: whole chunks are checked and forwarded as they are."""
    d = ChunkedDecoder()
    n = 0
    for c in chunks:
        if d.idle:
            _payload, used = whole_chunks(c)
            if used == len(c):
                n += used
                continue
            d.feed(c[used:])
            n += used
        else:
            d.feed(c)
    return n


CHUNK_WRITES = [b"%x\r\n%b\r\n" % (len(w), w) for w in WRITES]  # one chunk per read


def test_chunked_decode_reframe_per_token(benchmark: Any) -> None:
    assert benchmark(_decode_reframe, CHUNK_WRITES) == sum(map(len, CHUNK_WRITES))


def test_chunked_pass_through_per_token(benchmark: Any) -> None:
    assert benchmark(_pass_through, CHUNK_WRITES) == sum(map(len, CHUNK_WRITES))

"""Hop-by-hop and framing header filter table (RFC 9110 7.6.1, RFC 9112 6)."""

from __future__ import annotations

import pytest

from sidecar.core.headers import (
    REQUEST_DROP,
    RESPONSE_DROP,
    filter_headers,
    is_event_stream,
    set_header,
)

H = list[tuple[bytes, bytes]]


@pytest.mark.parametrize(
    ("headers", "drop", "expected"),
    [
        (
            [(b"Content-Type", b"application/json")],
            RESPONSE_DROP,
            [(b"Content-Type", b"application/json")],
        ),
        ([(b"Connection", b"keep-alive")], RESPONSE_DROP, []),
        ([(b"Keep-Alive", b"timeout=5")], RESPONSE_DROP, []),
        ([(b"Proxy-Connection", b"keep-alive")], REQUEST_DROP, []),
        ([(b"TE", b"trailers")], REQUEST_DROP, []),
        ([(b"Transfer-Encoding", b"chunked")], RESPONSE_DROP, []),
        ([(b"Upgrade", b"websocket")], REQUEST_DROP, []),
        ([(b"Trailer", b"X-T")], RESPONSE_DROP, []),
        ([(b"Content-Length", b"12")], RESPONSE_DROP, [(b"Content-Length", b"12")]),
        ([(b"Content-Length", b"12")], REQUEST_DROP, [(b"Content-Length", b"12")]),
        ([(b"Expect", b"100-continue")], REQUEST_DROP, []),
        ([(b"Expect", b"100-continue")], RESPONSE_DROP, [(b"Expect", b"100-continue")]),
        (
            [(b"Connection", b"close, X-Foo"), (b"x-foo", b"1"), (b"X-Bar", b"2")],
            RESPONSE_DROP,
            [(b"X-Bar", b"2")],
        ),
        ([(b"CONNECTION", b"X-A,  x-b "), (b"X-A", b"1"), (b"X-B", b"2")], REQUEST_DROP, []),
        ([(b"Authorization", b"Bearer k")], REQUEST_DROP, [(b"Authorization", b"Bearer k")]),
        (
            [(b"Set-Cookie", b"a"), (b"Set-Cookie", b"b")],
            RESPONSE_DROP,
            [(b"Set-Cookie", b"a"), (b"Set-Cookie", b"b")],
        ),
    ],
)
def test_filter(headers: H, drop: frozenset[bytes], expected: H) -> None:
    assert filter_headers(headers, drop) == expected


@pytest.mark.parametrize(
    ("ctype", "expected"),
    [
        (b"text/event-stream", True),
        (b"text/event-stream; charset=utf-8", True),
        (b"Text/Event-Stream", True),
        (b"application/json", False),
        (None, False),
    ],
)
def test_is_event_stream(ctype: bytes | None, expected: bool) -> None:
    headers = [] if ctype is None else [(b"content-type", ctype)]
    assert is_event_stream(headers) is expected


def test_set_header_replaces() -> None:
    h = [(b"cache-control", b"max-age=5"), (b"X", b"1"), (b"Cache-Control", b"x")]
    assert set_header(h, b"Cache-Control", b"no-cache") == [
        (b"X", b"1"),
        (b"Cache-Control", b"no-cache"),
    ]

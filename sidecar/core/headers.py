"""Header filtering for the relay (sans-I/O).

Theory of operation
-------------------
A proxy forwards end-to-end fields and drops hop-by-hop ones (RFC 9110
section 7.6.1): ``Connection`` and every field it names, ``Proxy-Connection``,
``Keep-Alive``, ``TE``, ``Transfer-Encoding`` and ``Upgrade``.  ``Trailer`` is
dropped too because trailers are not relayed.  Framing is chosen by h11 on each
side (RFC 9112 section 6): ``Transfer-Encoding`` never crosses the proxy, while
a validated ``Content-Length`` is kept so HEAD and 304 responses and fixed-size
bodies keep their length.  The sidecar answers ``Expect: 100-continue`` itself
(RFC 9110 section 10.1.1), so ``Expect`` is not forwarded either.

Header names are compared case-insensitively; the original case of forwarded
names is kept.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "HOP_BY_HOP",
    "REQUEST_DROP",
    "RESPONSE_DROP",
    "Headers",
    "connection_tokens",
    "filter_headers",
    "get_header",
    "is_event_stream",
    "response_headers",
]

Headers = list[tuple[bytes, bytes]]

# RFC 9110 section 7.6.1 (plus Trailer, see module docstring).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"te",
        b"transfer-encoding",
        b"upgrade",
        b"trailer",
    }
)
REQUEST_DROP = HOP_BY_HOP | {b"expect"}
RESPONSE_DROP = HOP_BY_HOP


def connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Lower-cased field names listed in ``Connection`` (RFC 9110 section 7.6.1)."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(tokens)


# Fields a ``Connection`` option may never remove: the message's own framing.  A
# hostile ``Connection: content-length`` must not turn a POST into one without its
# length (the body would be lost or read as the next request).
NEVER_CONNECTION_OPTION = frozenset({b"content-length", b"transfer-encoding"})


def filter_headers(
    headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes] = HOP_BY_HOP
) -> Headers:
    """Forwardable headers: ``drop`` and the fields named by ``Connection`` removed."""
    items = list(headers)
    named = connection_tokens(items) - NEVER_CONNECTION_OPTION
    return [(n, v) for n, v in items if (low := n.lower()) not in drop and low not in named]


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The upstream response fields to relay downstream.

    RFC 9112 section 6.3: with both ``Transfer-Encoding`` and ``Content-Length``
    the transfer coding frames the body, and an intermediary "MUST first remove
    the received Content-Length field" before forwarding: a length the body does
    not have would desynchronise the client's connection.
    """
    items = list(headers)
    drop = RESPONSE_DROP
    if get_header(items, b"transfer-encoding") is not None:
        drop = drop | {b"content-length"}
    return filter_headers(items, drop)


def get_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of ``name`` (lower-case), or None."""
    for n, v in headers:
        if n.lower() == name:
            return v
    return None


def is_event_stream(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    ctype = get_header(headers, b"content-type")
    if ctype is None:
        return False
    return ctype.split(b";", 1)[0].strip().lower() == b"text/event-stream"


def set_header(headers: Headers, name: bytes, value: bytes) -> Headers:
    """Replace every ``name`` field by one ``name: value`` (name given in display case)."""
    low = name.lower()
    out = [(n, v) for n, v in headers if n.lower() != low]
    out.append((name, value))
    return out

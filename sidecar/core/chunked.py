"""Incremental decoder for HTTP/1.1 chunked bodies (sans-I/O).

Theory of operation
-------------------
RFC 9112 section 7.1: ``chunk = chunk-size [ chunk-ext ] CRLF chunk-data CRLF``,
ended by ``last-chunk [ trailer-section ] CRLF``.  h11 decodes this too, but it
returns one event per chunk, and llama-server writes one chunk per token, so a
64 KiB read of a fast stream means hundreds of Python-level events.  This
decoder returns *all* the data in a read as one ``bytes`` with a handful of
C-level ``find``/slice operations per chunk.  The upstream client uses it for
response bodies only, after h11 has parsed the head; h11 still handles every
request and response head and every other framing.

Chunk extensions are ignored (RFC 9112 section 7.1.1 allows that); trailer
fields are read and dropped (the sidecar does not relay trailers).  A bare LF
is accepted as a line end, like h11 does.  Malformed framing raises
:class:`ChunkedError`.

Framing: :func:`frame` is the one place a chunk is written (the relay's
downstream writes, keepalive comments, re-framed pieces of a split chunk).

Pass-through: :func:`whole_chunks` finds the prefix of a read that is a run of
complete data chunks in canonical form (hex size, no extension, CRLF, data,
CRLF).  Those bytes are valid chunked framing as they stand, so a relay whose
downstream is chunked too may write them unchanged instead of decoding and
re-framing (the payload is still returned, for scanning).  What follows the
prefix (a partial chunk, the last-chunk, an extension, a bare LF) goes through
the decoder: whole chunks leave an :attr:`~ChunkedDecoder.idle` decoder exactly
where it was, so the two can take turns on one body.
"""

from __future__ import annotations

import re

__all__ = ["ChunkedDecoder", "ChunkedError", "frame", "whole_chunks"]

MAX_LINE = 4096  # chunk-size line or trailer line
MAX_TRAILER = 16 * 1024  # the whole trailer section
_HEX = frozenset(b"0123456789abcdefABCDEF")
_SIZE_LINE = re.compile(rb"([0-9a-fA-F]{1,15})\r\n")


def frame(data: bytes) -> bytes:
    """``data`` as one chunk (RFC 9112 section 7.1); ``b""`` for no data.

    An empty chunk would be the last-chunk, so nothing is written for it.
    """
    if not data:
        return b""
    return b"%x\r\n%b\r\n" % (len(data), data)


def whole_chunks(data: bytes) -> tuple[bytes, int]:
    """The longest prefix of ``data`` made of complete canonical data chunks.

    Returns its payload and its length in ``data`` (``(b"", 0)`` if ``data``
    does not start with one).  One regex match and two slices per chunk, which
    is cheaper than the decoder's state machine; the caller may forward
    ``data[:length]`` as it stands (see the module docstring).
    """
    match = _SIZE_LINE.match
    n = len(data)
    pos = 0
    parts: list[bytes] = []
    while pos < n:
        m = match(data, pos)
        if m is None:
            break
        start = m.end()
        end = start + int(m.group(1), 16)
        if end == start or data[end : end + 2] != b"\r\n":
            break  # the last-chunk, or incomplete / malformed: the decoder's job
        parts.append(data[start:end])
        pos = end + 2
    if len(parts) == 1:
        return parts[0], pos  # the usual case: one token, one chunk, one read
    return b"".join(parts), pos


class ChunkedError(ValueError):
    """Malformed framing; ``partial`` is the data of the complete chunks before it."""

    def __init__(self, message: str, partial: bytes = b"") -> None:
        super().__init__(message)
        self.partial = partial


class ChunkedDecoder:
    __slots__ = ("_buf", "_remaining", "_state", "_trailer", "done")

    # states: "size" (expecting a size line), "data" (_remaining bytes of data),
    # "crlf" (the CRLF after chunk data), "trailer" (trailer lines until empty)
    def __init__(self) -> None:
        self._buf = b""
        self._state = "size"
        self._remaining = 0
        self._trailer = 0  # trailer bytes so far
        self.done = False

    @property
    def idle(self) -> bool:
        """At the start of a chunk with nothing buffered (see :func:`whole_chunks`)."""
        return self._state == "size" and not self._buf and not self.done

    @property
    def leftover(self) -> bytes:
        """Bytes received after the end of the body (must be empty for reuse)."""
        return self._buf if self.done else b""

    def feed(self, data: bytes) -> bytes:
        """Decode ``data``; returns the body bytes it completes (maybe ``b""``).

        Raises :class:`ChunkedError` on malformed framing, with the data of the
        chunks before it in ``partial`` (the caller may still deliver those).
        """
        if self.done:
            if data and not self._buf:
                self._buf = data[:64]  # only whether there was any matters (no reuse)
            return b""
        out: list[bytes] = []
        try:
            return self._feed(data, out)
        except ChunkedError as exc:
            exc.partial = b"".join(out)
            raise

    def _feed(self, data: bytes, out: list[bytes]) -> bytes:
        buf = self._buf + data if self._buf else data
        pos = 0
        n = len(buf)
        state = self._state
        remaining = self._remaining
        while pos < n:
            if state == "data":
                take = min(remaining, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                remaining -= take
                if remaining == 0:
                    state = "crlf"
                continue
            if state == "crlf":
                if buf[pos] == 0x0A:  # bare LF
                    pos += 1
                    state = "size"
                    continue
                if n - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ChunkedError("missing CRLF after chunk data")
                pos += 2
                state = "size"
                continue
            # "size" or "trailer": both need a complete line
            eol = buf.find(b"\n", pos)
            if eol < 0:
                if n - pos > MAX_LINE:
                    raise ChunkedError("chunk-size or trailer line too long")
                break
            line = buf[pos:eol]
            pos = eol + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if state == "trailer":
                if not line:
                    self.done = True
                    break
                self._trailer += len(line) + 2
                if self._trailer > MAX_TRAILER:
                    raise ChunkedError("trailer section too long")
                continue
            size = line.split(b";", 1)[0].strip(b" \t")
            if not size or len(size) > 16 or not _HEX.issuperset(size):
                raise ChunkedError(f"bad chunk size line {line[:40]!r}")
            remaining = int(size, 16)
            state = "data" if remaining else "trailer"
        self._buf = buf[pos:]
        self._state = state
        self._remaining = remaining
        if len(out) == 1:
            return out[0]
        return b"".join(out)

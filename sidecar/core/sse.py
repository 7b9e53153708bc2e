"""Incremental ``text/event-stream`` scanner on bytes (sans-I/O).

Theory of operation
-------------------
The scanner follows the WHATWG HTML "Interpreting an event stream" algorithm
(HTML Living Standard, section 9.2.6) at the line level only: it never decodes
UTF-8 and never builds the ``data`` buffer, because the sidecar forwards the
bytes unchanged and only needs to know

* which comment lines went by (park notices are comments), and
* whether the bytes seen so far end exactly at an *event boundary*, i.e. at the
  start of a line with no field line pending since the last blank line.  Only
  there may the relay inject a keepalive comment without changing the meaning
  of the stream for the client.

Lines end in ``\\r\\n``, ``\\n`` or a lone ``\\r`` (WHATWG 9.2.5, ``end-of-line``).
A ``\\r`` at the end of a chunk already ends the line; if the next chunk starts
with ``\\n`` that byte belongs to the same line ending and is skipped.  Hence any
split of a stream into chunks yields the same list of :class:`Line` items.

A trailing unterminated line at end of stream is never reported (WHATWG: an
incomplete event is discarded at end of file).  A leading byte-order mark is not
special-cased: llama-server never sends one.

Work is linear in the bytes fed and memory is bounded: of a line split across
reads only the first ``MAX_KEPT`` bytes are kept (a longer line is reported
cut to about that size; the relay needs only a comment's first words and
whether a line is a comment at all), so a 16 MB line without a newline costs
one pass over its bytes, not a copy of everything so far on every read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Blank", "Comment", "Field", "Line", "SSEScanner"]

# WHATWG 9.2.5: end-of-line = ( cr lf / cr / lf )
_EOL = re.compile(rb"\r\n|\r|\n")
# Bytes kept of a line that is still incomplete at the end of a read.
MAX_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Comment:
    """A line starting with ``:``; ``text`` is everything after the colon."""

    text: bytes


@dataclass(frozen=True, slots=True)
class Field:
    """A ``name: value`` line (one optional space after the colon removed)."""

    name: bytes
    value: bytes


@dataclass(frozen=True, slots=True)
class Blank:
    """An empty line: dispatches the pending event (if any fields were seen)."""


Line = Comment | Field | Blank
_BLANK = Blank()


class SSEScanner:
    """Feed bytes, get the complete lines they finish.

    ``at_boundary`` is true when the bytes fed so far end at the start of a line
    and no field line is pending (only comments or nothing since the last blank
    line), so a complete comment block may be inserted here.
    """

    __slots__ = ("_partial", "_pending_fields", "_skip_lf")

    def __init__(self) -> None:
        self._partial = b""
        self._skip_lf = False
        self._pending_fields = False

    @property
    def at_boundary(self) -> bool:
        return not self._partial and not self._pending_fields

    @property
    def in_event(self) -> bool:
        """True once a field line was seen and its terminating blank line was not."""
        return self._pending_fields

    def feed(self, data: bytes) -> list[Line]:
        if not data:
            return []
        start = 0
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == 0x0A:  # the \n of a \r\n split across reads
                start = 1
        out: list[Line] = []
        n = len(data)
        for m in _EOL.finditer(data, start):
            end = m.start()
            if self._partial:
                line = self._partial + data[start : min(end, start + MAX_KEPT)]
                self._partial = b""
            else:
                line = data[start:end]
            start = m.end()
            if start == n and start - end == 1 and data[end] == 0x0D:
                # Lone \r at the end of the chunk: the line is over, a following
                # \n (next read) is part of the same end-of-line.
                self._skip_lf = True
            out.append(self._line(line))
        if start < n:
            self._keep(data, start)
        return out

    def _keep(self, data: bytes, start: int) -> None:
        """Add ``data[start:]`` to the incomplete line, up to ``MAX_KEPT`` bytes."""
        room = MAX_KEPT - len(self._partial)
        if room > 0:
            self._partial += data[start : start + room]

    def feed_comments(self, data: bytes) -> list[bytes]:
        """Like :meth:`feed` but returns only the comment texts: the relay's fast path.

        When the chunk holds no ``\r`` (llama-server writes ``\n`` only) the
        lines are split in C and only comment lines become objects; otherwise
        this falls back to :meth:`feed`.  The scanner state afterwards is the
        same either way (property-tested).
        """
        if self._skip_lf or b"\r" in data:
            return [line.text for line in self.feed(data) if type(line) is Comment]
        if not data:
            return []
        if self._partial:
            if b"\n" not in data:  # still the same line: keep its head only
                self._keep(data, 0)
                return []
            data = self._partial + data
        if data[-2:] == b"\n\n" and data[0] != 0x3A and b"\n:" not in data:
            # Whole events and no comment line (a comment starts the data or
            # follows a \n): the usual read of a token stream, decided in C.
            self._partial = b""
            self._pending_fields = False
            return []
        lines = data.split(b"\n")
        self._partial = lines.pop()[:MAX_KEPT]
        if not lines:
            return []
        # The last blank or field line decides whether an event is pending.
        for line in reversed(lines):
            if not line:
                self._pending_fields = False
                break
            if line[0] != 0x3A:
                self._pending_fields = True
                break
        return [line[1:] for line in lines if line[:1] == b":"]

    def _line(self, line: bytes) -> Line:
        if not line:
            self._pending_fields = False
            return _BLANK
        if line[0] == 0x3A:  # ":" -- a comment, ignored by clients
            return Comment(line[1:])
        self._pending_fields = True
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        return Field(name, value)

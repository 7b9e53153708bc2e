"""Is a request body text that llama-server's JSON parser takes?  UTF-8, no lone surrogate.

llama-server's parser refuses a body that is not UTF-8 (CESU-8 surrogate bytes such as
``ED A0 80`` included) and a ``\\uD800``-style escape of a surrogate that is not half of a
pair; it answers those with a 500.  When the sidecar reads a body anyway (a priority rule
is on), it refuses them first with a 400 that says why (:mod:`sidecar.relay`).

:class:`TextCheck` is fed the body piece by piece, in order, and keeps a few bytes of the
previous piece (an escape or a run of backslashes may be cut anywhere):

* UTF-8: Python's strict incremental decoder, which refuses encoded surrogates;
* escapes: ``\\u`` preceded by an odd run of backslashes is an escape (an even run is
  escaped backslashes and a literal ``u``).  A high surrogate (``D800``-``DBFF``) must be
  followed at once by an escaped low one (``DC00``-``DFFF``), and a low one must be the
  second half of such a pair.  Outside a string an escape is a syntax error that the parser
  reports anyway, so strings need not be tracked.

Pieces without ``\\u`` cost one ``bytes.find``, so ordinary bodies pay two C-speed scans.
Pure: no I/O.
"""

from __future__ import annotations

import codecs
import re

__all__ = ["BadText", "TextCheck"]

# "\u" of a surrogate escape at a real escape: the backslash run before "u" is odd
_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_QUICK = re.compile(rb"\\u[dD][89a-fA-F]")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
# bytes of lookahead a decision needs: the escape ("\uXXXX") and its pair
_AHEAD = 12


class BadText(ValueError):
    """The body is not text llama-server's JSON parser takes (the message says why)."""


class TextCheck:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("strict")
        self._carry = b""  # the end of the previous piece, not decided yet
        self._skip = 0  # escapes at positions below this in the carry were decided
        self._base = 0  # absolute offset of the carry's first byte
        self._paired_low = -1  # absolute offset of the low half of the last pair seen
        self.size = 0

    def feed(self, data: bytes) -> None:
        """The next piece of the body; raises :class:`BadText`."""
        try:
            self._utf8.decode(data)
        except UnicodeDecodeError as exc:
            raise BadText(f"the body is not UTF-8 (near byte {self.size}: {exc.reason})") from None
        self.size += len(data)
        self._scan(self._carry + data, final=False)

    def finish(self) -> None:
        """The body ended; raises :class:`BadText`."""
        try:
            self._utf8.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise BadText(
                f"the body is not UTF-8 (it ends inside a character: {exc.reason})"
            ) from None
        self._scan(self._carry, final=True)
        self._carry = b""

    def _scan(self, buf: bytes, *, final: bool) -> None:
        # not final: the last bytes stay undecided (with any backslash run reaching into
        # them and the byte before it, for the look-behind: see the carry below)
        cut = len(buf) if final else max(self._skip, len(buf) - _AHEAD)
        if b"\\u" in buf and _QUICK.search(buf):
            for m in _SURROGATE.finditer(buf):
                pos = m.end() - 6  # the escape's backslash
                if pos < self._skip:
                    continue
                if pos >= cut:
                    break
                self._check(buf, pos, self._base + pos)
        if final:
            return
        start = cut
        while start > 0 and buf[start - 1 : start] == b"\\":
            start -= 1
        start = max(0, start - 1)
        self._carry = buf[start:]
        self._skip = cut - start
        self._base += start

    def _check(self, buf: bytes, pos: int, absolute: int) -> None:
        high = buf[pos + 3 : pos + 4] in b"89abAB"
        if high:
            if _LOW.match(buf, pos + 6) is None:
                raise BadText(
                    f"the body has an unpaired surrogate escape {_show(buf, pos)} at byte "
                    f"{absolute} (a high surrogate must be followed by a low one)"
                )
            self._paired_low = absolute + 6
        elif absolute != self._paired_low:
            raise BadText(
                f"the body has an unpaired surrogate escape {_show(buf, pos)} at byte "
                f"{absolute} (a low surrogate must follow a high one)"
            )


def _show(buf: bytes, pos: int) -> str:
    return buf[pos : pos + 6].decode("ascii", "replace")

"""Is a request body text that llama-server's JSON parser takes?  UTF-8, no lone surrogate.

llama-server's parser refuses a body that is not UTF-8 (CESU-8 surrogate bytes such as
``ED A0 80`` included) and a ``\\uD800``-style escape of a surrogate that is not half of a
pair; it answers those with a 500.  When the sidecar reads a body anyway (a priority rule
is on), it refuses them first with a 400 that says why (:mod:`sidecar.proxy.relay`).

:class:`TextCheck` is fed the body piece by piece, in order:

* UTF-8: Python's strict incremental decoder, which refuses encoded surrogates;
* escapes: ``\\u`` preceded by an odd run of backslashes is an escape (an even run is
  escaped backslashes and a literal ``u``).  A high surrogate (``D800``-``DBFF``) must be
  followed at once by an escaped low one (``DC00``-``DFFF``), and a low one must be the
  second half of such a pair.  Outside a string an escape is a syntax error that the parser
  reports anyway, so strings need not be tracked.

One regular expression finds, at C speed, the only places that can be wrong: a high not
followed by a low, a low not preceded by a high, and a pair whose high has more than one
backslash before its ``u`` (it may be literal text, leaving the low alone).  Only those
candidates cost Python work: the parity of the backslash run before them.  Valid text
(emoji written as escaped pairs included) has no candidate at all.

Pieces may cut an escape or a run of backslashes anywhere, so the last bytes of a piece
are decided with the next one.  What is kept of them is bounded: the last 20 bytes, and
the parity of the backslash run before them (a run of a megabyte is kept as one or two
backslashes).  The work is linear in the body whatever it holds.  Pure: no I/O.
"""

from __future__ import annotations

import codecs
import re

__all__ = ["BadText", "TextCheck"]

_HIGH = rb"\\u[dD][89abAB][0-9a-fA-F]{2}"
_LOW = rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_CANDIDATE = re.compile(
    rb"(?P<pair>\\" + _HIGH + _LOW + rb")"  # a pair whose high may be literal text
    rb"|(?P<high>" + _HIGH + rb")(?!" + _LOW + rb")"  # a high alone
    # a low alone (the look-behind comes after the backslash, so that every branch starts
    # with one and the engine skips to the next backslash at C speed)
    rb"|(?P<low>\\(?<!" + _HIGH + rb"\\)" + _LOW[2:] + rb")"
)
# bytes left undecided at the end of a piece: a candidate is at most 13 bytes long and
# looks 6 bytes around itself
_AHEAD = 20
_BEHIND = 8


class BadText(ValueError):
    """The body is not text llama-server's JSON parser takes (the message says why)."""


class TextCheck:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("strict")
        self._carry = b""  # undecided bytes, after a parity-preserving stand-in prefix
        self._skip = 0  # candidates starting below this index of the carry were decided
        self._base = 0  # absolute offset of the carry's index 0 (for messages)
        self.size = 0

    def feed(self, data: bytes) -> None:
        """The next piece of the body; raises :class:`BadText`."""
        try:
            self._utf8.decode(data)
        except UnicodeDecodeError as exc:
            raise BadText(f"the body is not UTF-8 (near byte {self.size}: {exc.reason})") from None
        self.size += len(data)
        if data:
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
        cut = len(buf) if final else max(self._skip, len(buf) - _AHEAD)
        if b"\\u" in buf:
            for m in _CANDIDATE.finditer(buf, self._skip):
                if m.start() >= cut:
                    break
                self._judge(buf, m)
        if final:
            return
        # keep buf[keep:], and before it a stand-in for the backslash run that ends at
        # `keep`: "x" and that run's parity, so that the next scan reads it the same way
        keep = max(0, cut - _BEHIND)
        run = _run_before(buf, keep)
        stand_in = b"x" + b"\\" * (run % 2)
        self._carry = stand_in + buf[keep:]
        self._skip = len(stand_in) + (cut - keep)
        self._base += keep - len(stand_in)

    def _judge(self, buf: bytes, m: re.Match[bytes]) -> None:
        if m.group("pair") is not None:
            high = m.start() + 1
            if _run_before(buf, high + 1) % 2 == 1:
                return  # the high is an escape: a real pair
            at, what = high + 6, "a low surrogate must follow a high one"
        elif m.group("high") is not None:
            at, what = m.start(), "a high surrogate must be followed by a low one"
        else:
            at, what = m.start(), "a low surrogate must follow a high one"
        if _run_before(buf, at + 1) % 2 == 0:
            return  # "\\" + "uD800": an escaped backslash, then text
        shown = buf[at : at + 6].decode("ascii")
        raise BadText(
            f"the body has an unpaired surrogate escape {shown} near byte "
            f"{max(0, self._base + at)} ({what})"
        )


def _run_before(buf: bytes, end: int) -> int:
    """The length of the run of backslashes that ends at ``buf[end - 1]``."""
    width = 16
    while True:
        start = max(0, end - width)
        seg = buf[start:end]
        run = len(seg) - len(seg.rstrip(b"\\"))
        if run < len(seg) or start == 0:
            return run
        width *= 8

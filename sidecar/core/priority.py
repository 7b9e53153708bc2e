"""Request priority set by the operator: which API key or header gets which ``priority``.

llama-server (patched) reads an integer ``priority`` from a completion body: when the KV
pool is full it parks the lowest priority first and restores the highest first.  Clients
must not choose their own, so once an operator configures any rule the sidecar gives
*every* request that llama-server would run as a generation the operator's priority, or
refuses it: the priority of the request's API key (``--priority-keys 'KEY=10,OTHER=-5'``),
else the value of the header named by ``--priority-header`` (``X-Priority``, say; name
only a header that a trusted hop sets or strips, such as nginx setting it per route), else
``--priority-default`` (0).  Which requests generate is :mod:`sidecar.core.routes`' business.

Theory of operation: the splice
-------------------------------
The field is not set by parsing the body and writing it out again (for a body of many
small values that held the interpreter for seconds and took tens of times the body's size
in memory).  It is *spliced in*: ``,"priority":N`` goes right before the body's last
``}``.  That is the closing brace of the top-level object whenever llama-server can parse
the result at all, and there the member is the object's last, and llama-server's JSON
parser keeps the last of duplicate keys, so a ``"priority"`` of the client's own, however
its key is spelled (``"pri\\u006frity"``), is overridden.  Why the splice is safe for any
body, valid or not: call what comes before the last ``}`` P.  If P leaves the parser
inside a string, a key, after a colon or a comma, inside a literal or a number's exponent,
or inside a nested object or array, then P + ``,"priority":N}`` does not parse (the
member lands where no member may be, or the top-level object is never closed), and
llama-server refuses it without generating (a 500 with its parser's message).  Only when P
ends after a complete member of the top-level object does the result parse, and then it
carries the operator's value.

What the parser accepts beyond JSON is handled before the splice: it stops reading at a
NUL byte (so ``{...}\\0{"priority":...}`` would hide the spliced member behind the NUL: a
body with a NUL byte is refused) and skips a UTF-8 byte order mark at the very start (so
does :class:`PrioritySplice`).  A body whose first byte (past the mark and whitespace) is
not ``{`` or whose last is not ``}`` is not a JSON object and is refused; ``{}`` gets the
member without the comma.

:class:`PrioritySplice` is fed the body piece by piece, in order, and keeps a few offsets
(no copy of the body, no parse), so its work is a few C-speed scans per piece and its
memory a constant.  Everything here is pure: no I/O, tested with tables.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "NotAnObject", "PriorityRules", "PrioritySplice", "parse_priority_keys", "priority_value",
    "with_priority",
]  # fmt: skip

LIMIT = 1_000_000  # llama-server's bounds for the field
BOM = b"\xef\xbb\xbf"
WHITESPACE = b" \t\r\n"  # JSON's whitespace (RFC 8259 section 2), all of it
_NON_WS = re.compile(rb"[^ \t\r\n]")


def parse_priority_keys(spec: str | None) -> dict[str, int]:
    """``"KEY=10,OTHER=-5"`` -> ``{"KEY": 10, "OTHER": -5}``; a clear ValueError otherwise."""
    out: dict[str, int] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.rpartition("=")
        if not sep or not key:
            raise ValueError(f"priority keys: expected KEY=PRIORITY, got {item!r}")
        out[key] = priority_value(value, f"priority of key {key[:4]}...")
    return out


def priority_value(value: str | int, what: str) -> int:
    """``value`` as a priority llama-server takes, or a ValueError naming ``what``."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: not an integer: {value!r}") from None
    if not -LIMIT <= number <= LIMIT:
        raise ValueError(f"{what}: {number} is outside -{LIMIT}..{LIMIT}")
    return number


@dataclass(frozen=True, slots=True)
class PriorityRules:
    by_key: Mapping[str, int] = field(default_factory=dict)
    header: bytes | None = None  # the trusted header's name, lower case
    default: int = 0

    @property
    def active(self) -> bool:
        """Whether the sidecar sets priorities at all (any rule configured)."""
        return bool(self.by_key) or self.header is not None or self.default != 0

    def priority_for(self, api_key: str | None, header: bytes | None) -> int:
        """The request's priority: its key's, else the trusted header's value, else the default.

        ``header`` is the request's value of :attr:`header` (None when absent or when no
        header is trusted); a malformed value is ignored and the default applies.
        """
        if api_key is not None and api_key in self.by_key:
            return self.by_key[api_key]
        if self.header is not None and header is not None:
            try:
                return priority_value(header.decode("ascii").strip(), "X-Priority")
            except (UnicodeDecodeError, ValueError):
                pass
        return self.default


class NotAnObject(ValueError):
    """A body the priority cannot be spliced into; the message says why (for the 400)."""


class PrioritySplice:
    """Where ``"priority"`` goes in a body fed in order with :meth:`feed` (see the module).

    After the last piece, :meth:`finish` gives the offset of the top-level closing brace
    and the text to insert there, or raises :class:`NotAnObject`.
    """

    __slots__ = ("_first", "_first_byte", "_last", "_last_byte", "_nul", "_second", "size")

    def __init__(self) -> None:
        self.size = 0  # bytes fed so far
        self._first: int | None = None  # offset of the first byte past the BOM and whitespace
        self._first_byte = 0
        self._second: int | None = None  # offset of the next one that is not whitespace
        self._last: int | None = None  # offset of the last byte that is not whitespace
        self._last_byte = 0
        self._nul = False

    def feed(self, data: bytes) -> None:
        start = 3 if self.size == 0 and data.startswith(BOM) else 0
        if b"\0" in data:
            self._nul = True
        kept = len(data.rstrip(WHITESPACE))  # no copy when nothing is stripped
        if kept > start:
            self._last, self._last_byte = self.size + kept - 1, data[kept - 1]
            if self._second is None:
                self._note_first_two(data, start)
        self.size += len(data)

    def _note_first_two(self, data: bytes, start: int) -> None:
        at = start
        while self._second is None and (found := _NON_WS.search(data, at)) is not None:
            if self._first is None:
                self._first, self._first_byte = self.size + found.start(), data[found.start()]
            else:
                self._second = self.size + found.start()
            at = found.start() + 1

    def finish(self, priority: int) -> tuple[int, bytes]:
        """``(offset, text)``: insert ``text`` before the byte at ``offset``."""
        if self._first is None or self._last is None:
            raise NotAnObject("the body is empty; a JSON object is required")
        if self._nul:
            raise NotAnObject("the body has a NUL byte; it must be one JSON object")
        if self._first_byte != ord("{") or self._last_byte != ord("}") or self._first == self._last:
            raise NotAnObject("the body is not a JSON object")
        member = b'"priority":%d' % priority_value(priority, "priority")
        return self._last, member if self._second == self._last else b"," + member


def with_priority(body: bytes | Iterable[bytes], priority: int) -> bytes:
    """``body`` with the operator's priority spliced in, or :class:`NotAnObject`."""
    pieces = [body] if isinstance(body, bytes) else list(body)
    splice = PrioritySplice()
    for piece in pieces:
        splice.feed(piece)
    at, text = splice.finish(priority)
    whole = b"".join(pieces)
    return whole[:at] + text + whole[at:]

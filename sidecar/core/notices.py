"""Park notice classifier and per-stream parked-prompt set (sans-I/O).

Theory of operation
-------------------
The patched llama-server announces KV preemption to streaming clients as SSE
comment lines (docs/preemption.md, "Stream notices")::

    : preempted        : resumed        : recomputed        : preempt-keepalive
    : preempted 1      (multi-prompt streams append the prompt index)

Stock servers send a bare ``:`` as a ping.  :func:`classify` maps the text of a
comment (what follows the colon) to a :class:`Notice`; anything else is
``OTHER``.  :class:`ParkTracker` keeps the set of parked prompts of one stream
and reports park transitions so the relay can count parks, resumes and park
durations.  A stream is *parked* while that set is non-empty.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Notice", "NoticeKind", "ParkEnded", "ParkStarted", "ParkTracker", "classify"]


class NoticeKind(enum.Enum):
    PREEMPTED = "preempted"
    RESUMED = "resumed"
    RECOMPUTED = "recomputed"
    PREEMPT_KEEPALIVE = "preempt_keepalive"
    PING = "ping"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Notice:
    kind: NoticeKind
    index: int | None = None


_WORDS = {
    b"preempted": NoticeKind.PREEMPTED,
    b"resumed": NoticeKind.RESUMED,
    b"recomputed": NoticeKind.RECOMPUTED,
    b"preempt-keepalive": NoticeKind.PREEMPT_KEEPALIVE,
}
_PING = Notice(NoticeKind.PING)
_OTHER = Notice(NoticeKind.OTHER)


def classify(text: bytes) -> Notice:
    """Classify the text of an SSE comment (the bytes after the leading ``:``)."""
    if text[:1] == b" ":
        text = text[1:]
    if not text.strip(b" \t"):
        return _PING
    word, sep, rest = text.partition(b" ")
    kind = _WORDS.get(word)
    if kind is None:
        return _OTHER
    if not sep:
        return Notice(kind)
    if rest.isdigit() and len(rest) <= 6:
        return Notice(kind, int(rest))
    return _OTHER


@dataclass(frozen=True, slots=True)
class ParkStarted:
    index: int | None


@dataclass(frozen=True, slots=True)
class ParkEnded:
    index: int | None
    duration: float
    recomputed: bool
    since: float = 0.0  # when the park started (the time given to apply())


ParkChange = ParkStarted | ParkEnded


class ParkTracker:
    """The parked prompts of one stream, keyed by prompt index (``None`` = unindexed)."""

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since: dict[int | None, float] = {}

    @property
    def parked(self) -> bool:
        return bool(self._since)

    @property
    def parked_count(self) -> int:
        return len(self._since)

    def apply(self, notice: Notice, now: float) -> ParkChange | None:
        kind = notice.kind
        if kind is NoticeKind.PREEMPTED:
            if notice.index in self._since:
                return None  # repeated notice for an already parked prompt
            self._since[notice.index] = now
            return ParkStarted(notice.index)
        if kind is NoticeKind.RESUMED or kind is NoticeKind.RECOMPUTED:
            since = self._since.pop(notice.index, None)
            if since is None:
                return None
            return ParkEnded(notice.index, now - since, kind is NoticeKind.RECOMPUTED, since)
        return None

    def close(self, now: float) -> list[ParkEnded]:
        """End of stream: every still-parked prompt ends its park here."""
        ended = [ParkEnded(i, now - t, False, t) for i, t in self._since.items()]
        self._since.clear()
        return ended

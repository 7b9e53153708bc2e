"""The bookkeeping of one relayed response: :class:`StreamMonitor` (sans-I/O).

Theory of operation
-------------------
Everything the sidecar knows about a response it relays is decided here, from
the bytes it writes to the client and the times it writes them; the relay
only moves bytes and calls in.  One monitor per exchange, fed ``(bytes, now)``:

* the :class:`Phase` of the response once upstream answered (prompt,
  streaming, parked): with the exchange's own state before that (request,
  queued), the label of a client disconnect;
* for an event stream (``text/event-stream``), the SSE scanner
  (:class:`~sidecar.core.sse.SSEScanner`: comment lines and event boundaries), the
  park notices (:func:`~sidecar.core.notices.classify`) and the set of parked
  prompts (:class:`~sidecar.core.notices.ParkTracker`), and the keepalive policy
  (:class:`~sidecar.core.keepalive.KeepalivePolicy`);
* counters for the access log and the metrics: time to first byte, bytes,
  parks, park time, keepalives, the longest silence the client saw.

The relay calls

* :meth:`~StreamMonitor.answered` with the response head, and
  :meth:`~StreamMonitor.opened_early` if it answered the client before
  upstream did (``--early-open-after``; the stream, and its keepalives, start
  then);
* :meth:`~StreamMonitor.feed` with every piece of the body *as it writes it
  downstream*: the piece counts as a write for the keepalive clock, and the
  notices it completes come back as :class:`NoticeSeen` items (usually none)
  for the live metrics;
* :meth:`~StreamMonitor.keepalive_due` from its timer: the comment to write
  now, if any (only at an event boundary, see :mod:`sidecar.core.keepalive`; the
  relay says whether upstream has yet to answer an early open), which the
  monitor then counts as written; :meth:`~StreamMonitor.next_check` says
  when to ask again;
* :meth:`~StreamMonitor.finish` at the end: a :class:`StreamStats`.

Waiting for an event boundary needs no polling: a keepalive that is due
inside an event waits for the rest of that event, and the rest is itself a
write, which restarts the silence clock; asking again one interval later
is therefore never late.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.core.keepalive import Keepalive, KeepalivePolicy
from sidecar.core.notices import (
    NoticeKind,
    ParkChange,
    ParkEnded,
    ParkStarted,
    ParkTracker,
    classify,
)
from sidecar.core.sse import SSEScanner

__all__ = ["NoticeSeen", "Phase", "StreamMonitor", "StreamStats"]


class Phase(enum.Enum):
    """Where an exchange is; the label of a client disconnect."""

    REQUEST = "request"  # reading the request
    QUEUED = "queued"  # sent upstream, no response head yet
    PROMPT = "prompt"  # response head in, no body byte yet
    STREAMING = "streaming"  # body bytes flowing
    PARKED = "parked"  # an event stream with a parked prompt


@dataclass(frozen=True, slots=True)
class NoticeSeen:
    """One comment line of an event stream, as the live metrics need it."""

    kind: NoticeKind
    change: ParkChange | None = None  # the park it started or ended
    parked: bool | None = None  # the stream's new parked state, if it flipped


@dataclass(frozen=True, slots=True)
class StreamStats:
    """What :meth:`StreamMonitor.finish` reports about one response."""

    phase: Phase  # at the end
    event_stream: bool
    duration: float
    ttfb: float | None
    bytes_out: int
    parks: int
    parked_seconds: float
    keepalives: int
    longest_silence: float | None  # event streams only
    parked_at_end: bool
    unended_parks: tuple[ParkEnded, ...]  # still parked at the end: closed here


_NOTHING: tuple[NoticeSeen, ...] = ()


class StreamMonitor:
    __slots__ = (
        "_idle_interval",
        "_lead",
        "_park_interval",
        "_policy",
        "_scanner",
        "bytes_out",
        "event_stream",
        "keepalives",
        "parked_seconds",
        "parks",
        "t0",
        "tracker",
        "ttfb",
    )

    def __init__(
        self, now: float, park_interval: float, idle_interval: float, *, lead: float = 0.0
    ) -> None:
        self.t0 = now
        self._park_interval = park_interval
        self._idle_interval = idle_interval
        self._lead = lead
        self.event_stream = False
        self._scanner = SSEScanner()
        self.tracker = ParkTracker()
        self._policy: KeepalivePolicy | None = None
        self.ttfb: float | None = None
        self.bytes_out = 0
        self.parks = 0
        self.parked_seconds = 0.0
        self.keepalives = 0

    # ------------------------------------------------------------ milestones

    def opened_early(self, now: float) -> bool:
        """The client got a ``text/event-stream`` head before upstream answered.

        Returns True (the stream starts now), for symmetry with :meth:`answered`.
        """
        self._start(now)
        return True

    def answered(self, now: float, *, event_stream: bool) -> bool:
        """Upstream's response head arrived; True if an event stream starts now."""
        if event_stream and self._policy is None:
            self._start(now)
            return True
        return False

    def _start(self, now: float) -> None:
        self.event_stream = True
        self._policy = KeepalivePolicy(
            self._park_interval, self._idle_interval, now, lead=self._lead
        )

    # -------------------------------------------------------------- the body

    def feed(self, data: bytes, now: float) -> Sequence[NoticeSeen]:
        """``data`` is written to the client at ``now``; the notices it completed."""
        if self.ttfb is None:
            self.ttfb = now - self.t0
        self.bytes_out += len(data)
        policy = self._policy
        if policy is None:
            return _NOTHING
        # policy.wrote(now), inlined: this runs once per relayed event
        gap = now - policy.last_write
        if gap > policy.longest_silence:
            policy.longest_silence = gap
        policy.last_write = now
        texts = self._scanner.feed_comments(data)
        if not texts:
            return _NOTHING
        return [self._comment(text, now) for text in texts]

    def _comment(self, text: bytes, now: float) -> NoticeSeen:
        notice = classify(text)
        kind = notice.kind
        if kind is NoticeKind.OTHER or kind is NoticeKind.PING:
            return NoticeSeen(kind)
        tracker = self.tracker
        was_parked = tracker.parked
        change = tracker.apply(notice, now)
        if type(change) is ParkStarted:
            self.parks += 1
        elif type(change) is ParkEnded:
            self.parked_seconds += change.duration
        parked = tracker.parked
        if parked == was_parked:
            return NoticeSeen(kind, change)
        return NoticeSeen(kind, change, parked)

    @property
    def phase(self) -> Phase:
        """Of the response, from what was written: no byte yet, bytes, a prompt parked."""
        if self.tracker.parked:
            return Phase.PARKED
        return Phase.PROMPT if self.ttfb is None else Phase.STREAMING

    # ------------------------------------------------------------- keepalive

    def keepalive_due(self, now: float, *, early_open: bool = False) -> Keepalive | None:
        """The comment to write at ``now``, or None; a returned one counts as written.

        ``early_open``: the client got our head and upstream has not answered yet.
        """
        policy = self._policy
        if policy is None:
            return None
        ka = policy.due(
            now,
            parked=self.tracker.parked,
            at_boundary=self._scanner.at_boundary,
            early_open=early_open,
        )
        if ka is not None:
            policy.wrote(now)
            self.keepalives += 1
        return ka

    def next_check(self, now: float) -> float:
        """Seconds until :meth:`keepalive_due` may have something to write."""
        policy = self._policy
        if policy is None:
            return self._idle_interval
        parked = self.tracker.parked
        delay = policy.deadline(parked) - now
        if delay <= 0:
            # Due inside an event: the rest of the event is a write and restarts
            # the clock, so one interval from now is never late.
            return policy.interval(parked)
        if not parked:
            # A park may start at any moment and shorten the interval; its
            # notice is a write, so checking every park interval suffices.
            return min(delay, policy.park_interval)
        return delay

    # ------------------------------------------------------------------- end

    def finish(self, now: float) -> StreamStats:
        """The figures of the response; parks still open end here."""
        phase = self.phase
        parked_at_end = self.tracker.parked
        unended = tuple(self.tracker.close(now))
        for ended in unended:
            self.parked_seconds += ended.duration
        policy = self._policy
        return StreamStats(
            phase=phase,
            event_stream=self.event_stream,
            duration=now - self.t0,
            ttfb=self.ttfb,
            bytes_out=self.bytes_out,
            parks=self.parks,
            parked_seconds=self.parked_seconds,
            keepalives=self.keepalives,
            longest_silence=None if policy is None else policy.silence(now),
            parked_at_end=parked_at_end,
            unended_parks=unended,
        )

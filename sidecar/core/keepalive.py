"""Keepalive policy for SSE streams, with an injected clock (sans-I/O).

Theory of operation
-------------------
The sidecar guarantees that an event stream is never silent downstream for
longer than an interval: ``park_interval`` (default 1 s) while any prompt of
the stream is parked, ``idle_interval`` (default 10 s) otherwise.  Silence is
measured from the last byte *written to the client* (upstream bytes relayed
count, so a chatty upstream never gets extra comments).

A keepalive is a complete comment block (``: preempt-keepalive`` while parked,
``: keepalive`` otherwise, each followed by a blank line) and is only allowed at
an event boundary (see :class:`sidecar.core.sse.SSEScanner.at_boundary`): inside an
event a comment plus blank line would dispatch a half-built event.  When the
deadline passes inside an event the policy waits for the boundary.

``lead`` (a fraction of the interval, 0 by default; the relay uses 0.1) makes
the comment due that much *before* the interval is up, so event-loop lag under
load (thousands of parked streams whose deadlines coincide) is absorbed and
the client still never waits longer than the interval.

The relay calls :meth:`KeepalivePolicy.wrote` after each downstream write and
:meth:`KeepalivePolicy.due` from its ticker; :meth:`deadline` tells the ticker
when to look again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["KEEPALIVE_IDLE", "KEEPALIVE_PARK", "Keepalive", "KeepalivePolicy", "Reason"]


class Reason(enum.Enum):
    PARK = "park"
    IDLE = "idle"
    EARLY_OPEN = "early_open"


@dataclass(frozen=True, slots=True)
class Keepalive:
    reason: Reason
    payload: bytes


KEEPALIVE_PARK = Keepalive(Reason.PARK, b": preempt-keepalive\n\n")
KEEPALIVE_IDLE = Keepalive(Reason.IDLE, b": keepalive\n\n")
KEEPALIVE_EARLY = Keepalive(Reason.EARLY_OPEN, b": keepalive\n\n")


class KeepalivePolicy:
    __slots__ = ("idle_interval", "last_write", "longest_silence", "park_interval")

    def __init__(
        self, park_interval: float, idle_interval: float, now: float, *, lead: float = 0.0
    ) -> None:
        if park_interval <= 0 or idle_interval <= 0:
            raise ValueError("keepalive intervals must be positive")
        if not 0.0 <= lead < 1.0:
            raise ValueError("lead must be a fraction in [0, 1)")
        self.park_interval = park_interval * (1.0 - lead)
        self.idle_interval = idle_interval * (1.0 - lead)
        self.last_write = now
        self.longest_silence = 0.0

    def interval(self, parked: bool) -> float:
        return self.park_interval if parked else self.idle_interval

    def deadline(self, parked: bool) -> float:
        """Monotonic time at which a keepalive becomes due."""
        return self.last_write + self.interval(parked)

    def wrote(self, now: float) -> None:
        """Record a downstream write (relayed bytes or a keepalive) at ``now``."""
        gap = now - self.last_write
        if gap > self.longest_silence:
            self.longest_silence = gap
        self.last_write = now

    def due(
        self, now: float, *, parked: bool, at_boundary: bool, early_open: bool = False
    ) -> Keepalive | None:
        """The keepalive to write now, or None (not yet due, or inside an event)."""
        if now < self.deadline(parked) or not at_boundary:
            return None
        if parked:
            return KEEPALIVE_PARK
        return KEEPALIVE_EARLY if early_open else KEEPALIVE_IDLE

    def silence(self, now: float) -> float:
        """Longest silence so far, counting the current one up to ``now``."""
        return max(self.longest_silence, now - self.last_write)

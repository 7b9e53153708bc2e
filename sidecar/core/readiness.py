"""Readiness for load balancers: should new work come to this pair right now?

``/healthz`` says the sidecar process is alive; ``/ready`` says whether a balancer in front
of several llama-server + sidecar pairs should send this pair *new* requests.  A pair that
is parking conversations has a full KV pool: every new request it admits makes some
stream wait longer, while another pair may have room.  So ``/ready`` answers 503 while
llama-server reports parked requests (``llamacpp:requests_preempted``), or, where the
server exports its KV pool size, while the free share of the pool is below
``ready_min_free_kv``.  Streams already running are never touched: readiness only steers
new connections at the balancer.

The state is read from llama-server's own ``/metrics`` (it must run with ``--metrics``),
polled every ``ready_poll`` seconds by :func:`~sidecar.proxy.ready_poll.poll_upstream`
through the proxy's upstream pool.  :class:`Readiness` is this part: it is fed the
metrics text (or a failure) with the time, and gives a :class:`Verdict` for a given
time.  It never does I/O, so the whole policy is tested with tables.  Failing safe:
before the first reading, after a failed poll, or when the last reading is older than
three poll intervals, the verdict is "not ready" with the reason.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

__all__ = [
    "KV_TOTAL",
    "KV_USED",
    "MAX_READING_BYTES",
    "PARKED",
    "Readiness",
    "Verdict",
    "parse_samples",
]

log = logging.getLogger("sidecar.core.readiness")

# llama-server's /metrics is a few KiB; a reading larger than this is not one (a wrong URL, a
# misbehaving upstream) and is a failed poll, not a body held in memory without bound
MAX_READING_BYTES = 1 << 20

PARKED = "llamacpp:requests_preempted"
KV_USED = "llamacpp:kv_cells_used"
KV_TOTAL = "llamacpp:kv_cells_total"
STALE_AFTER_POLLS = 3


def parse_samples(text: str) -> dict[str, float]:
    """Prometheus text format -> ``{name: value}`` for unlabelled samples (comments skipped).

    llama-server's metrics carry no labels; a labelled sample is kept under its bare name
    only when it is the first one seen, which is all readiness needs.  Lines that do not
    parse are ignored: a reading is judged by the samples it has, not by its neighbours.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ")
        name = name_part.split("{", 1)[0]
        value = rest.strip().split(" ", 1)[0]
        try:
            number = float(value)
        except ValueError:
            continue
        out.setdefault(name, number)
    return out


@dataclass(frozen=True, slots=True)
class Verdict:
    ready: bool
    reason: str

    def body(self) -> bytes:
        return (("ready" if self.ready else "not ready") + f": {self.reason}\n").encode()


class Readiness:
    """The readiness policy over the latest reading of llama-server's metrics."""

    def __init__(self, poll_interval: float, min_free_kv: float = 0.0) -> None:
        if poll_interval < 0:
            raise ValueError("poll_interval must not be negative (0: readiness off)")
        if not 0.0 <= min_free_kv < 1.0:
            raise ValueError("min_free_kv is a share of the pool: 0 <= share < 1")
        self.poll_interval = poll_interval
        self.min_free_kv = min_free_kv
        self._at: float | None = None  # time of the last successful reading
        self._samples: dict[str, float] = {}
        self._failure: str | None = (
            "no reading from llama-server yet"
            if poll_interval > 0
            else "readiness is off (--ready-poll 0)"
        )
        self.flips = 0  # how often the verdict changed between readings
        self._last_ready: bool | None = None

    def observe(self, metrics_text: str, now: float) -> None:
        self._samples = parse_samples(metrics_text)
        self._at = now
        parked = self._samples.get(PARKED)
        if parked is None:
            self._failure = f"llama-server's /metrics has no {PARKED} (not the patched server?)"
        elif not math.isfinite(parked) or parked < 0:
            self._failure = f"llama-server's /metrics has {PARKED} {parked}: not a count"
        else:
            self._failure = None
        self._note(now)

    def failed(self, why: str, now: float) -> None:
        self._failure = f"llama-server's /metrics did not answer: {why}"
        self._note(now)

    def _note(self, now: float) -> None:
        verdict = self.verdict(now)
        if self._last_ready is not None and verdict.ready != self._last_ready:
            self.flips += 1
            log.info("%s: %s", "ready" if verdict.ready else "not ready", verdict.reason)
        self._last_ready = verdict.ready

    def verdict(self, now: float) -> Verdict:
        if self._failure is not None:
            return Verdict(False, self._failure)
        assert self._at is not None
        age = now - self._at
        if age > STALE_AFTER_POLLS * self.poll_interval:
            return Verdict(False, f"last reading is {age:.1f} s old")
        parked = self._samples[PARKED]
        if parked > 0:
            return Verdict(False, f"{parked:.0f} request(s) parked")
        total = self._samples.get(KV_TOTAL, 0.0)
        if self.min_free_kv > 0 and total > 0 and KV_USED in self._samples:
            free = 1.0 - self._samples[KV_USED] / total
            if free < self.min_free_kv:
                return Verdict(False, f"free KV {free:.0%} < {self.min_free_kv:.0%}")
            return Verdict(True, f"no parked requests, free KV {free:.0%}")
        return Verdict(True, "no parked requests")

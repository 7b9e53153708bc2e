"""Prometheus metrics of the sidecar, on an explicit ``CollectorRegistry``.

Theory of operation
-------------------
:class:`Metrics` creates every collector on the registry it is given, so each
test (and each sidecar in one process) gets its own.  Names carry the
``llama_sidecar_`` prefix and base units (seconds, bytes); histograms reach an
hour because a parked stream may legitimately last that long.  Labels are
low-cardinality by construction: ``route`` comes from a fixed table of known
llama-server routes (anything else is ``other``), ``status_class`` is ``1xx``
to ``5xx`` or ``none``; no path, id or address ever becomes a label.

Label sets come from the enums that name the values (:class:`~sidecar.core.keepalive.Reason`,
:class:`~sidecar.core.notices.NoticeKind`, :class:`~sidecar.core.stream.Phase`, the kinds of
:class:`~sidecar.core.errors.UpstreamError`), and every label set is created up front so
dashboards see zeros, not gaps.  A relayed response is recorded from its
:class:`~sidecar.core.stream.StreamMonitor`: :meth:`Metrics.notice` for each park notice as it
passes (parks, resumes and the parked gauge are live), :meth:`Metrics.observe` with the
:class:`~sidecar.core.stream.StreamStats` at the end.

The exposition is served by :mod:`sidecar.proxy.server` on its own listener through
``prometheus_client.exposition.choose_encoder``.  Rendering it costs about 1.5 ms of
CPU on the event loop that relays every stream, so a client looping on ``/metrics``
could slow the proxy down: :class:`RenderLimiter` renders at most
``RENDER_RATE`` times a second (after a burst of ``RENDER_BURST``) and answers the
requests in between with the last rendering, which is then at most
``1 / RENDER_RATE`` seconds old.  A scraper every few seconds always gets a fresh one.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from sidecar import __version__
from sidecar.core.errors import UpstreamError
from sidecar.core.keepalive import Reason
from sidecar.core.notices import NoticeKind, ParkEnded, ParkStarted
from sidecar.core.stream import NoticeSeen, Phase, StreamStats

__all__ = [
    "DURATION_BUCKETS", "KNOWN_ROUTES", "Metrics", "RenderLimiter", "route_label", "status_class",
]  # fmt: skip

PREFIX = "llama_sidecar"

# Up to an hour: a stream may stay parked that long.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip

# llama-server (tools/server/server.cpp) routes; "/slots/<id>" folds into "/slots".
KNOWN_ROUTES = frozenset(
    {
        "/", "/health", "/v1/health", "/metrics", "/props", "/slots", "/models", "/v1/models",
        "/api/tags", "/api/show", "/api/chat", "/completion", "/completions", "/v1/completions",
        "/chat/completions", "/v1/chat/completions", "/v1/messages",
        "/v1/messages/count_tokens", "/infill", "/embedding", "/embeddings", "/v1/embeddings",
        "/rerank", "/reranking", "/v1/rerank", "/v1/reranking", "/tokenize", "/detokenize",
        "/apply-template", "/lora-adapters",
    }
)  # fmt: skip
# renderings of the exposition per second, and how many may come at once
RENDER_RATE = 10.0
RENDER_BURST = 10
UPSTREAM_ERROR_KINDS = tuple(sorted({c.kind for c in UpstreamError.__subclasses__()}))


class RenderLimiter:
    """A token bucket over renderings, with the last rendering of each kind kept.

    ``get(key, now, render)`` calls ``render()`` when a token is left (or when nothing
    was rendered for ``key`` yet) and returns the kept bytes otherwise.  Tokens come
    back at ``rate`` a second, up to ``burst``.  Pure: the caller passes the time.
    """

    def __init__(self, rate: float = RENDER_RATE, burst: int = RENDER_BURST) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be positive and burst at least 1")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at: float | None = None
        self._kept: dict[object, bytes] = {}
        self.renders = 0

    def get(self, key: object, now: float, render: Callable[[], bytes]) -> bytes:
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        kept = self._kept.get(key)
        if kept is not None and self._tokens < 1.0:
            return kept
        self._tokens = max(0.0, self._tokens - 1.0)
        body = self._kept[key] = render()
        self.renders += 1
        return body


def route_label(target: bytes | str) -> str:
    """The route label of a request target: a known route or ``"other"``."""
    path = target.decode("latin-1") if isinstance(target, bytes) else target
    path = path.split("?", 1)[0].split("#", 1)[0]
    if len(path) > 1:
        path = path.rstrip("/")
    if path.startswith("/slots/"):
        return "/slots"
    return path if path in KNOWN_ROUTES else "other"


def status_class(status: int | None) -> str:
    if status is None or not 100 <= status <= 599:
        return "none"
    return f"{status // 100}xx"


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        p = PREFIX
        self.streams_active = Gauge(
            f"{p}_streams_active", "SSE streams currently relayed", registry=r
        )
        self.streams_parked = Gauge(
            f"{p}_streams_parked", "SSE streams with at least one parked prompt", registry=r
        )
        self.parks = Counter(f"{p}_parks", "Prompts parked (': preempted' notices)", registry=r)
        self.resumes = Counter(
            f"{p}_resumes", "Parked prompts resumed (': resumed' notices)", registry=r
        )
        self.recomputes = Counter(
            f"{p}_recomputes", "Parked prompts re-prefilled (': recomputed' notices)", registry=r
        )
        self.park_duration = Histogram(
            f"{p}_park_duration_seconds",
            "Time from ': preempted' to ': resumed'/': recomputed' or stream end",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.keepalives = Counter(
            f"{p}_keepalives",
            "Keepalive comments written by the sidecar",
            ["reason"],
            registry=r,
        )
        self.upstream_comments = Counter(
            f"{p}_upstream_comments",
            "SSE comment lines relayed from upstream, by kind",
            ["kind"],
            registry=r,
        )
        self.requests = Counter(
            f"{p}_requests",
            "Requests handled, by route and status class",
            ["route", "status_class"],
            registry=r,
        )
        self.request_duration = Histogram(
            f"{p}_request_duration_seconds",
            "Time from request head to the end of the response",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            f"{p}_time_to_first_byte_seconds",
            "Time from request head to the first response body byte from upstream",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.longest_silence = Histogram(
            f"{p}_stream_longest_silence_seconds",
            "Longest gap between two writes to the client, per SSE stream",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.client_disconnects = Counter(
            f"{p}_client_disconnects",
            "Clients that went away before the response ended, by phase",
            ["phase"],
            registry=r,
        )
        self.send_timeouts = Counter(
            f"{p}_send_timeouts",
            "Clients cut off because they took no byte of their response for --send-timeout",
            registry=r,
        )
        self.upstream_errors = Counter(
            f"{p}_upstream_errors",
            "Upstream failures by kind (connect, timeout, protocol, disconnect)",
            ["kind"],
            registry=r,
        )
        self.bytes = Counter(
            f"{p}_bytes",
            "Body bytes relayed, by direction (request: client to upstream)",
            ["direction"],
            registry=r,
        )
        self.upstream_up = Gauge(
            f"{p}_upstream_up", "1 if the last upstream connect succeeded", registry=r
        )
        self.priority_requests = Counter(
            f"{p}_priority_requests",
            "Generating requests given the operator's priority (set), or refused because "
            "they could not be given it (refused)",
            ["outcome"],
            registry=r,
        )
        self.ready = Gauge(
            f"{p}_ready",
            "1 while /ready answers 200 (no parked requests upstream), else 0",
            registry=r,
        )
        self.build_info = Info(f"{p}_build", "Sidecar build information", registry=r)
        self.build_info.info({"version": __version__, "python": platform.python_version()})
        # Pre-create bounded label sets so dashboards see zeros, not gaps.
        for reason in Reason:
            self.keepalives.labels(reason.value)
        for notice in NoticeKind:
            self.upstream_comments.labels(notice.value)
        for phase in Phase:
            self.client_disconnects.labels(phase.value)
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(kind)
        for direction in ("request", "response"):
            self.bytes.labels(direction)
        for outcome in ("set", "refused"):
            self.priority_requests.labels(outcome)

    # ------------------------------------------------------- relayed responses

    def stream_started(self) -> None:
        self.streams_active.inc()

    def notice(self, seen: NoticeSeen) -> None:
        """One comment line of an event stream, as it is relayed."""
        self.upstream_comments.labels(seen.kind.value).inc()
        change = seen.change
        if type(change) is ParkStarted:
            self.parks.inc()
        elif type(change) is ParkEnded:
            (self.recomputes if change.recomputed else self.resumes).inc()
            self.park_duration.observe(change.duration)
        if seen.parked is not None:
            self.streams_parked.inc() if seen.parked else self.streams_parked.dec()

    def keepalive(self, reason: Reason) -> None:
        self.keepalives.labels(reason.value).inc()

    def disconnect(self, phase: Phase) -> None:
        self.client_disconnects.labels(phase.value).inc()

    def observe(self, stats: StreamStats, *, route: str, status: int | None, bytes_in: int) -> None:
        """One finished exchange: the request figures, and the end of its stream."""
        if stats.event_stream:
            self.streams_active.dec()
            if stats.parked_at_end:
                self.streams_parked.dec()
            for ended in stats.unended_parks:
                # Still parked at the end (client left, upstream died): the park
                # lasted this long, but it was neither resumed nor recomputed.
                self.park_duration.observe(ended.duration)
            if stats.longest_silence is not None:
                self.longest_silence.observe(stats.longest_silence)
        self.requests.labels(route, status_class(status)).inc()
        self.request_duration.labels(route).observe(stats.duration)
        if stats.ttfb is not None:
            self.ttfb.labels(route).observe(stats.ttfb)
        self.bytes.labels("request").inc(bytes_in)
        self.bytes.labels("response").inc(stats.bytes_out)

"""The relay: one request/response exchange between a client and llama-server.

Theory of operation
-------------------
:class:`Exchange` handles one request on an accepted client connection (an
:class:`~sidecar.adapter.H11Stream` in the h11 ``SERVER`` role):

1. *Checks* before anything is forwarded: conflicting framing (both
   ``Content-Length`` and ``Transfer-Encoding``, RFC 9112 section 6.1: reject and
   close), ``--api-key``, a declared body over ``--max-body``.
2. *Buffer*: the whole request body is read before upstream is contacted
   (``--body-timeout`` for all of it, ``--max-body``; ``Expect: 100-continue`` is
   answered after the checks), so a slow upload never holds a llama-server
   thread; bounded work per step, so tiny chunks cannot hold the loop.
3. *Forward*: the request head goes upstream with hop-by-hop fields removed,
   ``X-Forwarded-For``/``-Proto`` added and the body's ``Content-Length``.
4. *Respond*: one task group per exchange holds

   * the main task: wait for the upstream head, send it downstream, then pump
     body chunks (the *upstream pump*);
   * the *client-disconnect watcher*: a read on the client socket that
     returns EOF means the client left (the body is complete by now); it
     cancels the group, and the pump's ``finally`` closes the upstream
     connection at once so llama-server frees the slot;
   * the *keepalive ticker* (event streams only, and during early open): asks
     :class:`~sidecar.keepalive.KeepalivePolicy` whether a comment is due.

   Every downstream write (relayed bytes, keepalive comments, the head, the
   end of message) happens under ``self.lock``; the SSE scanner is fed under
   the same lock, so the ticker sees the boundary state of exactly the bytes
   already written and can never put a comment inside an event.
5. *Endings*: a clean upstream end sends the terminating chunk; an upstream
   that dies mid-body leaves the client's response unterminated (the
   connection is closed without the last chunk, so the client sees an error
   instead of a silently truncated answer); errors before the head become a
   JSON error response.  Metrics and the access-log line are recorded in a
   ``finally`` that runs under cancellation too.

Hot path (a chunked upstream body, i.e. every llama-server stream): the body
is relayed from the upstream read callback (:meth:`Exchange._deliver`), with
no task switch per event.  When the client's response is chunked as well,
the upstream's complete chunks are written as they arrived (scanned, never
decoded and re-encoded); only a chunk split across reads, or one in a
non-canonical form, is decoded and framed again.  Every write therefore ends
at a chunk boundary, so a keepalive comment written between two writes (at an
event boundary) is always its own chunk.

Early open (``--early-open-after S``): for a request that asked to stream
(``"stream": true`` in the body or ``Accept: text/event-stream``), if no
upstream head arrived S seconds after the request was forwarded, a 200
``text/event-stream`` head is sent and kept alive; an upstream error then
arrives as a single ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import h11

from sidecar.adapter import H11Stream
from sidecar.chunked import ChunkedDecoder, ChunkedError
from sidecar.config import Config
from sidecar.errors import (
    IO_ERRORS,
    BadRequest,
    ClientDisconnected,
    ClientError,
    MethodNotSupported,
    PayloadTooLarge,
    RequestTimeout,
    SidecarError,
    Unauthorized,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
    map_exceptions,
)
from sidecar.headers import (
    REQUEST_DROP,
    Headers,
    filter_headers,
    get_header,
    is_event_stream,
    response_headers,
    set_header,
)
from sidecar.keepalive import KeepalivePolicy, Reason
from sidecar.metrics import Metrics, route_label, status_class
from sidecar.notices import NoticeKind, ParkEnded, ParkStarted, ParkTracker, classify
from sidecar.priority import PRIORITY_ROUTES, PriorityRules, with_priority
from sidecar.sse import SSEScanner
from sidecar.upstream import (
    H11Response,
    RequestBody,
    ResponseHead,
    UpstreamClient,
    UpstreamResponse,
)

__all__ = ["AccessRecord", "Context", "Exchange", "answer_error", "client_side", "reason"]

access_log = logging.getLogger("sidecar.access")
log = logging.getLogger("sidecar")

# Routes answered without --api-key, like llama-server's own public endpoints.
PUBLIC_ROUTES = frozenset({b"/health", b"/v1/health"})
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
MAX_ERROR_BODY = 64 * 1024
# Work per step of reading a request body before the task yields (see _read_body):
# h11 events of a Content-Length body, and wire bytes of a chunked one (decoded by
# ChunkedDecoder); either is about a millisecond when every chunk holds one byte.
BODY_EVENTS_PER_STEP = 64
CHUNKED_STEP_BYTES = 4096
# bodies larger than this get their priority set on a worker thread (JSON parse and dump)
PRIORITY_INLINE_PARSE = 256 * 1024
# Keepalives are written at 90% of the interval: slack for event-loop lag.
KEEPALIVE_LEAD = 0.1
BOUNDARY_POLL = 0.01

_CLIENT_MAP = {
    h11.RemoteProtocolError: ClientError,
    h11.LocalProtocolError: BadRequest,
    anyio.BrokenResourceError: ClientDisconnected,
    anyio.ClosedResourceError: ClientDisconnected,
    anyio.EndOfStream: ClientDisconnected,
    OSError: ClientDisconnected,
}


@contextmanager
def client_side(client: H11Stream) -> Iterator[None]:
    """Translate failures talking to the client; a truncated message is a disconnect."""
    try:
        with map_exceptions(_CLIENT_MAP):
            yield
    except ClientError as exc:
        if client.eof:
            raise ClientDisconnected(str(exc)) from exc
        raise


@dataclass
class Context:
    """State shared by every connection of one sidecar."""

    config: Config
    metrics: Metrics
    upstream: UpstreamClient
    draining: bool = False
    active: int = 0
    clock: Any = time.monotonic
    priority: PriorityRules = field(init=False)

    def __post_init__(self) -> None:
        self.priority = self.config.priority_rules


@dataclass
class AccessRecord:
    method: str
    path: str
    status: int | None = None
    duration: float = 0.0
    ttfb: float | None = None
    parks: int = 0
    parked_seconds: float = 0.0
    keepalives: int = 0
    longest_silence: float | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    outcome: str = "ok"
    extra: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        d = asdict(self)
        d.pop("extra")
        d.update(self.extra)
        if d["status"] is None:
            d["status"] = 499 if self.outcome == "client_disconnected" else 0
        for k in ("duration", "ttfb", "parked_seconds", "longest_silence"):
            if d[k] is not None:
                d[k] = round(d[k], 6)
        return json.dumps(d, separators=(",", ":"))


def _error_body(status: int, message: str) -> dict[str, Any]:
    kind = (
        "authentication_error"
        if status == 401
        else "invalid_request_error"
        if status < 500
        else "unavailable_error"
        if status in (502, 503, 504)
        else "server_error"
    )
    return {"error": {"code": status, "message": message, "type": kind}}


def reason(status: int) -> bytes:
    """The standard reason phrase (RFC 9110 section 15), ``b""`` for an unknown code."""
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


async def answer_error(
    client: H11Stream, status: int, message: str, headers: Headers | None = None
) -> bool:
    """Send a JSON error response with ``Connection: close`` if nothing was sent yet."""
    if client.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return False
    body = json.dumps(_error_body(status, message)).encode()
    head = [
        (b"Content-Type", b"application/json; charset=utf-8"),
        (b"Content-Length", str(len(body)).encode()),
        (b"Connection", b"close"),
    ]
    if status == 401:
        # RFC 9110 section 11.6.1: a 401 carries the challenge it wants answered.
        head.append((b"WWW-Authenticate", b"Bearer"))
    head += headers or []
    try:
        await client.send(h11.Response(status_code=status, headers=head, reason=reason(status)))
        await client.send_data(body)
        await client.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        return False
    except IO_ERRORS:
        return False
    return True


class Exchange:
    def __init__(
        self, ctx: Context, client: H11Stream, request: h11.Request, peer: str | None
    ) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.metrics = ctx.metrics
        self.client = client
        self.request = request
        self.peer = peer
        self.clock = ctx.clock
        self.t0 = self.clock()
        self.route = route_label(request.target)
        self.rec = AccessRecord(
            request.method.decode("latin-1"), request.target.decode("latin-1", "replace")
        )
        # fast_acquire: no extra event-loop round trip per write when uncontended.
        self.lock = anyio.Lock(fast_acquire=True)
        self.phase = "request"
        self.started = False  # response head sent downstream
        self.finished = False  # end of message sent downstream
        self.client_gone = False
        self.keep_alive = True
        self.sse = False
        self.early_opened = False
        self.upstream_answered = False
        self.wants_stream = False
        self.scanner = SSEScanner()
        self.parks = ParkTracker()
        self.policy: KeepalivePolicy | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._error: SidecarError | None = None
        self._stream_tail = b""
        self._key_given: str | None = None  # the API key the client sent, if any
        self._loop = asyncio.get_running_loop()
        self._ka_timer: asyncio.TimerHandle | None = None
        self._ka_stopped = False

    # ------------------------------------------------------------------ entry

    async def run(self) -> bool:
        """Handle the exchange; True if the client connection may be reused."""
        self.ctx.active += 1
        try:
            self._check_request()
            await self._relay()
        except ClientDisconnected:
            self.rec.outcome = "client_disconnected"
            self.metrics.client_disconnects.labels(self.phase).inc()
            self.keep_alive = False
        except ClientError as exc:
            self.rec.outcome = exc.kind
            self.keep_alive = False
            if not self.started and await answer_error(self.client, exc.status_hint, str(exc)):
                self.rec.status = exc.status_hint
        except UpstreamError as exc:
            self.rec.outcome = "upstream_" + exc.kind
            self.metrics.upstream_errors.labels(exc.kind).inc()
            if isinstance(exc, UpstreamConnectError | UpstreamTimeout):
                self.metrics.upstream_up.set(0)
            self.keep_alive = False
            if not self.started and await answer_error(self.client, exc.status_hint, str(exc)):
                self.rec.status = exc.status_hint
        except SidecarError as exc:
            # Our own failure (the connection loop logs it and closes).
            self.rec.outcome = exc.kind
            self.keep_alive = False
            raise
        except anyio.get_cancelled_exc_class():
            # Cancelled from outside (drain timeout, stop): not an "ok" in the log.
            if self.rec.outcome == "ok":
                self.rec.outcome = "cancelled"
            self.keep_alive = False
            raise
        finally:
            self._stop_keepalive()
            self.ctx.active -= 1
            with anyio.CancelScope(shield=True):
                self._record()
        return self.keep_alive and not self.ctx.draining

    def _check_request(self) -> None:
        req = self.request
        raw = list(req.headers.raw_items())
        te = get_header(raw, b"transfer-encoding")
        cl = get_header(raw, b"content-length")
        if te is not None and cl is not None:
            # RFC 9112 section 6.1: may reject, and must close afterwards.
            raise BadRequest("both Content-Length and Transfer-Encoding present")
        if req.method == b"CONNECT":
            # A tunnel, not a request to relay (RFC 9110 section 9.3.6).
            raise MethodNotSupported("CONNECT is not supported")
        if cl is not None and int(cl) > self.config.max_body:
            raise PayloadTooLarge(f"request body of {int(cl)} bytes exceeds {self.config.max_body}")
        auth = get_header(raw, b"authorization") or b""
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else None
        given = given or get_header(raw, b"x-api-key")
        self._key_given = None if given is None else given.decode("latin-1")
        key = self.config.api_key
        public = req.target.split(b"?", 1)[0] in PUBLIC_ROUTES
        if key and not public and (given is None or not hmac.compare_digest(given, key.encode())):
            raise Unauthorized("invalid or missing API key")
        self._chunked_body = te is not None
        self._has_body = te is not None or (cl is not None and int(cl) > 0)
        accept = get_header(raw, b"accept") or b""
        self.wants_stream = b"text/event-stream" in accept.lower()

    def _upstream_headers(self) -> Headers:
        """The request head for upstream; the body (if any) gets its Content-Length later."""
        req = self.request
        headers = filter_headers(req.headers.raw_items(), REQUEST_DROP)
        if self.peer:
            prior = get_header(headers, b"x-forwarded-for")
            peer = self.peer.encode()
            headers = set_header(
                headers, b"X-Forwarded-For", prior + b", " + peer if prior else peer
            )
        if get_header(headers, b"x-forwarded-proto") is None:
            headers.append((b"X-Forwarded-Proto", b"http"))
        if get_header(headers, b"host") is None:
            host, port, _ = self.config.upstream_addr
            headers.append((b"Host", f"{host}:{port}".encode()))
        return headers

    # ------------------------------------------------------------ request body

    async def _read_body(self) -> RequestBody | None:
        """The whole request body, read before upstream is contacted.

        As nginx's request buffering does: a slow or stalled upload holds a
        sidecar connection (cheap), never a llama-server HTTP thread.  The
        body has ``body_timeout`` seconds in all (408), at most ``max_body``
        bytes (413); up to ``body_buffer`` bytes stay in memory, the rest goes
        to a temporary file.  The work between two yields is bounded
        (``BODY_EVENTS_PER_STEP``, ``CHUNKED_STEP_BYTES``), so a body of tiny
        chunks cannot hold the event loop; a chunked body is decoded by
        :class:`~sidecar.chunked.ChunkedDecoder` (five times cheaper per chunk
        than h11) and its connection closes after the response.
        """
        client = self.client
        if not self._has_body:
            with client_side(client):
                event = await client.next_event()
            if not isinstance(event, h11.EndOfMessage):
                raise BadRequest("unexpected request body")
            return None
        cfg = self.config
        body = RequestBody(cfg.body_buffer)
        try:
            with anyio.fail_after(cfg.body_timeout):
                await self._fill_body(body)
        except TimeoutError:
            body.close()
            raise RequestTimeout("request body not received in time") from None
        except BaseException:
            body.close()
            raise
        return body

    async def _fill_body(self, body: RequestBody) -> None:
        client = self.client
        limit = self.config.max_body
        with client_side(client):
            if client.conn.they_are_waiting_for_100_continue:
                # RFC 9110 section 10.1.1: the checks passed, so go ahead.
                await client.send(h11.InformationalResponse(status_code=100, headers=[]))
            decoder = ChunkedDecoder() if self._chunked_body else None
            while True:
                if decoder is None:
                    data, end = await client.next_body_piece(BODY_EVENTS_PER_STEP)
                else:
                    try:
                        data, end = await client.next_chunked_piece(decoder, CHUNKED_STEP_BYTES)
                    except ChunkedError as exc:
                        raise BadRequest(f"bad chunked request body: {exc}") from exc
                if body.size + len(data) > limit:
                    raise PayloadTooLarge(f"request body exceeds {limit} bytes")
                body.append(data)
                self.rec.bytes_in = body.size
                if data and not self.wants_stream:
                    scan = self._stream_tail + data
                    self.wants_stream = _STREAM_TRUE.search(scan) is not None
                    self._stream_tail = scan[-32:]
                if end:
                    return
                await anyio.lowlevel.checkpoint()  # one read's work, then the others

    # ------------------------------------------------------------------ relay

    async def _with_priority(self, body: RequestBody | None) -> RequestBody | None:
        """The body with the operator's ``priority`` set (sidecar/priority.py) where it applies.

        Only JSON completion bodies, and only once a priority rule is configured; a body that
        does not parse as a JSON object goes through unchanged and is counted.  A large
        body is parsed on a worker thread so that the event loop keeps serving.
        """
        rules, req = self.ctx.priority, self.request
        route = req.target.split(b"?", 1)[0]
        if body is None or not rules.active or req.method != b"POST":
            return body
        if route not in PRIORITY_ROUTES:
            return body
        header = get_header(req.headers.raw_items(), rules.header) if rules.header else None
        priority = rules.priority_for(self._key_given, header)
        raw = b"".join(body.pieces())
        if len(raw) > PRIORITY_INLINE_PARSE:
            rewritten = await anyio.to_thread.run_sync(with_priority, raw, priority)
        else:
            rewritten = with_priority(raw, priority)
        if rewritten is None:
            self.metrics.priority_requests.labels("unparsed").inc()
            return body
        body.close()
        body = RequestBody(self.config.body_buffer)
        body.append(rewritten)
        self.metrics.priority_requests.labels("set").inc()
        self.rec.extra["priority"] = priority
        return body

    async def _relay(self) -> None:
        body = await self._with_priority(await self._read_body())
        self.phase = "queued"
        try:
            await self._relay_body(body)
        finally:
            if body is not None:
                body.close()

    async def _relay_body(self, body: RequestBody | None) -> None:
        headers = self._upstream_headers()
        if body is not None:
            headers = set_header(headers, b"Content-Length", b"%d" % body.size)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._watch_client)
            if self.config.early_open_after is not None and self.request.method != b"HEAD":
                tg.start_soon(self._early_open_timer, self.config.early_open_after)
            try:
                await self._forward(headers, body)
            except SidecarError as exc:
                self._error = exc
            finally:
                tg.cancel_scope.cancel()
                self._stop_keepalive()
        if self._error is not None:
            raise self._error
        if self.client_gone:
            raise ClientDisconnected("client closed the connection")

    async def _forward(self, headers: Headers, body: RequestBody | None) -> None:
        req = self.request
        try:
            resp = await self.ctx.upstream.request(req.method, req.target, headers, body)
        except UpstreamError as exc:
            async with self.lock:
                self.upstream_answered = True
                if not self.early_opened:
                    raise
            await self._early_error(exc.status_hint, _error_body(exc.status_hint, str(exc)))
            self.rec.outcome = "upstream_" + exc.kind
            self.metrics.upstream_errors.labels(exc.kind).inc()
            return
        try:
            self.metrics.upstream_up.set(1)
            self.phase = "prompt"
            head = resp.head
            async with self.lock:
                self.upstream_answered = True
                early = self.early_opened
                if not early:
                    await self._send_head(head)
            if early and not (200 <= head.status < 300 and is_event_stream(head.headers)):
                await self._early_error_from(resp)
                return
            await self._pump(resp)
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()

    async def _send_head(self, head: ResponseHead) -> None:
        """Send the response head downstream (caller holds the lock)."""
        headers = response_headers(head.headers)
        sse = is_event_stream(headers)
        if sse:
            headers = set_header(headers, b"X-Accel-Buffering", b"no")
            headers = set_header(headers, b"Cache-Control", b"no-cache")
        if self.ctx.draining:
            headers.append((b"Connection", b"close"))
        with client_side(self.client):
            await self.client.send(
                h11.Response(status_code=head.status, headers=headers, reason=head.reason)
            )
        self.started = True
        self.rec.status = head.status
        if sse:
            self._start_stream()

    def _start_stream(self) -> None:
        self.sse = True
        self.policy = KeepalivePolicy(
            self.config.park_keepalive,
            self.config.idle_keepalive,
            self.clock(),
            lead=KEEPALIVE_LEAD,
        )
        self.metrics.streams_active.inc()
        if self.client.body_extensible:
            self._arm_keepalive(0.0)

    async def _pump(self, resp: UpstreamResponse) -> None:
        client = self.client
        if isinstance(resp, H11Response) and resp.can_relay:
            # Hot path: upstream bytes are decoded, scanned and written
            # downstream from the read callback (no task switch per event).
            await resp.relay(self._deliver, self._drain_client)
        else:
            while data := await resp.receive():
                async with self.lock:
                    if self._deliver(data):
                        await self._drain_client()
        async with self.lock:
            with client_side(client):
                await client.send(h11.EndOfMessage())
            self.finished = True

    def _deliver(self, data: bytes, wire: bytes | None = None) -> bool:
        """Relay one piece of the body downstream, synchronously.

        Runs in the upstream read callback on the hot path.  No task holds
        ``self.lock`` then (the head was sent, early open has settled, and the
        keepalive timer never awaits), and this write cannot be interleaved
        with another one, so it is as serialised as a write under the lock.
        ``wire`` is ``data`` in whole chunks as upstream framed them; a chunked
        downstream gets those bytes unchanged.  Whole chunks keep the
        downstream at a chunk boundary after every write, which is where the
        keepalive timer may add its comment.
        Returns True when downstream is backed up (the caller drains).
        """
        if self.rec.ttfb is None:
            self.rec.ttfb = self.clock() - self.t0
            if self.phase == "prompt":
                self.phase = "streaming"
        self.rec.bytes_out += len(data)
        if self.sse:
            for text in self.scanner.feed_comments(data):
                self._on_comment(text)
        client = self.client
        try:
            client.send_wire_now(data, wire)
        except Exception:
            # Translate only on the error path: a context manager per event costs.
            with client_side(client):
                raise
        if self.policy is not None:
            self.policy.wrote(self.clock())
        return client.backed_up

    async def _drain_client(self) -> None:
        with client_side(self.client):
            await self.client.drain()

    def _on_comment(self, text: bytes) -> None:
        notice = classify(text)
        m = self.metrics
        m.upstream_comments.labels(notice.kind.value).inc()
        if notice.kind is NoticeKind.OTHER or notice.kind is NoticeKind.PING:
            return
        was_parked = self.parks.parked
        change = self.parks.apply(notice, self.clock())
        if isinstance(change, ParkStarted):
            m.parks.inc()
            self.rec.parks += 1
        elif isinstance(change, ParkEnded):
            self._park_ended(change)
        if was_parked != self.parks.parked:
            if self.parks.parked:
                m.streams_parked.inc()
                self.phase = "parked"
            else:
                m.streams_parked.dec()
                self.phase = "streaming"

    def _park_ended(self, change: ParkEnded) -> None:
        (self.metrics.recomputes if change.recomputed else self.metrics.resumes).inc()
        self.metrics.park_duration.observe(change.duration)
        self.rec.parked_seconds += change.duration

    # --------------------------------------------------------- helper tasks

    async def _watch_client(self) -> None:
        await self.client.wait_for_eof()
        self.client_gone = True
        assert self._tg is not None
        self._tg.cancel_scope.cancel()

    def _keepalive_due(self) -> None:
        """Keepalive timer callback: write a comment if one is due, re-arm.

        One ``loop.call_later`` timer per stream instead of a sleeping task:
        thousands of parked streams then cost one heap entry each, and a due
        keepalive is written straight from the callback, so loop lag is all
        that stands between the deadline and the write.

        Nothing escapes a timer callback (the loop would only log it, and the
        keepalives would stop unseen): a failure ends the exchange instead.
        """
        self._ka_timer = None
        try:
            self._keepalive_tick()
        except Exception as exc:
            self._ka_stopped = True
            self._error = SidecarError(f"keepalive failed: {exc!r}")
            self._error.__cause__ = exc
            if self._tg is not None:
                self._tg.cancel_scope.cancel()

    def _keepalive_tick(self) -> None:
        policy = self.policy
        if policy is None or self.finished or self._ka_stopped:
            return
        now = self.clock()
        parked = self.parks.parked
        if self.lock.locked():
            # A task is between the parts of a write (head, error event, end):
            # never put a comment in there; look again shortly.
            self._arm_keepalive(BOUNDARY_POLL)
            return
        ka = policy.due(
            now,
            parked=parked,
            at_boundary=self.scanner.at_boundary,
            early_open=self.early_opened and not self.upstream_answered,
        )
        if ka is not None:
            try:
                self.client.send_data_now(ka.payload)
            except IO_ERRORS:
                self.client_gone = True
                assert self._tg is not None
                self._tg.cancel_scope.cancel()
                return
            now = self.clock()
            policy.wrote(now)
            self.rec.keepalives += 1
            self.metrics.keepalives.labels(ka.reason.value).inc()
        delay = policy.deadline(parked) - now
        if delay <= 0:
            # Due but inside an event: look again shortly.
            delay = BOUNDARY_POLL
        elif not parked:
            # A park may start at any moment and shorten the interval; its
            # notice is a write, so checking every park interval suffices.
            delay = min(delay, policy.park_interval)
        self._arm_keepalive(delay)

    def _arm_keepalive(self, delay: float) -> None:
        self._ka_timer = self._loop.call_later(delay, self._keepalive_due)

    def _stop_keepalive(self) -> None:
        self._ka_stopped = True
        if self._ka_timer is not None:
            self._ka_timer.cancel()
            self._ka_timer = None

    async def _early_open_timer(self, after: float) -> None:
        await anyio.sleep(after)
        async with self.lock:
            if self.upstream_answered or self.started or not self.wants_stream:
                return
            headers = [
                (b"Content-Type", b"text/event-stream"),
                (b"Cache-Control", b"no-cache"),
                (b"X-Accel-Buffering", b"no"),
            ]
            try:
                with client_side(self.client):
                    await self.client.send(h11.Response(status_code=200, headers=headers))
            except ClientDisconnected:
                self.client_gone = True
                assert self._tg is not None
                self._tg.cancel_scope.cancel()
                return
            self.early_opened = True
            self.started = True
            self.rec.status = 200
            self.rec.extra["early_open"] = True
            self._start_stream()

    async def _early_error_from(self, resp: UpstreamResponse) -> None:
        status = resp.head.status
        body = b""
        while len(body) < MAX_ERROR_BODY:
            chunk = await resp.receive()
            if not chunk:
                break
            body += chunk
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and "error" in parsed:
            payload: dict[str, Any] = {"error": parsed["error"]}
        elif isinstance(parsed, dict):
            payload = {"error": parsed}
        else:
            payload = _error_body(status, body.decode("utf-8", "replace").strip())
        if isinstance(payload["error"], dict):
            payload["error"].setdefault("code", status)
        self.rec.extra["upstream_status"] = status
        await self._early_error(status, payload)

    async def _early_error(self, status: int, payload: dict[str, Any]) -> None:
        """After an early open: deliver the upstream error as one event and end."""
        event = b"data: " + json.dumps(payload).encode() + b"\n\n"
        async with self.lock:
            with client_side(self.client):
                await self.client.send_data(event)
                await self.client.send(h11.EndOfMessage())
            self.finished = True
        self.rec.outcome = "early_open_error"

    # --------------------------------------------------------------- records

    def _record(self) -> None:
        now = self.clock()
        rec = self.rec
        m = self.metrics
        rec.duration = now - self.t0
        if self.sse:
            m.streams_active.dec()
            if self.parks.parked:
                m.streams_parked.dec()
            for ended in self.parks.close(now):
                # Still parked at the end (client left, upstream died): the park
                # lasted this long, but it was neither resumed nor recomputed.
                self.metrics.park_duration.observe(ended.duration)
                self.rec.parked_seconds += ended.duration
            if self.policy is not None:
                rec.longest_silence = self.policy.silence(now)
                m.longest_silence.observe(rec.longest_silence)
        m.requests.labels(self.route, status_class(rec.status)).inc()
        m.request_duration.labels(self.route).observe(rec.duration)
        if rec.ttfb is not None:
            m.ttfb.labels(self.route).observe(rec.ttfb)
        m.bytes.labels("request").inc(rec.bytes_in)
        m.bytes.labels("response").inc(rec.bytes_out)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(rec.line())


__all__ += ["Reason"]

"""The relay: one request/response exchange between a client and llama-server.

Theory of operation
-------------------
:class:`Exchange` handles one request on an accepted client connection (an
:class:`~sidecar.proxy.h11stream.H11Stream` in the h11 ``SERVER`` role), in four steps
that :meth:`Exchange.run` reads in order:

1. **check**: :func:`~sidecar.proxy.request.check_request` refuses what must not be
   forwarded, and :func:`~sidecar.proxy.request.read_body` buffers the whole request
   body (see :mod:`sidecar.proxy.request`);
2. **forward**: the request goes to the upstream pool (:mod:`sidecar.proxy.upstream`);
3. **respond**: the response head goes downstream and the body is relayed
   from the upstream read callback (:meth:`~sidecar.proxy.downstream.Downstream.piece`),
   each piece fed to the exchange's :class:`~sidecar.core.stream.StreamMonitor` as it
   is written;
4. **record**: the monitor's :class:`~sidecar.core.stream.StreamStats` go to the
   metrics and the access log, in a ``finally`` that runs under cancellation.

While steps 2 and 3 run, one task group holds the main task, a
*client-disconnect watcher* (a read on the client socket that returns EOF
means the client left; it cancels the group, and the upstream connection is
closed at once so llama-server frees the slot) and, with
``--early-open-after``, the early-open timer.  Keepalive comments come from a
``loop.call_later`` timer per event stream, not a task.

Where an exchange is, is one value: the :class:`~sidecar.proxy.downstream.State`
of its :class:`~sidecar.proxy.downstream.Downstream`, the writer every downstream
write goes through; the exchange calls it and reads its state, never keeps
flags of its own.  Why an exchange ended early (the client left, a keepalive
failed) is the error it will raise.

Downstream writes: the rule
---------------------------
Every downstream write is synchronous (:meth:`~sidecar.proxy.h11stream.H11Stream.write_event`,
:meth:`~sidecar.proxy.h11stream.H11Stream.write_data`: the bytes reach the transport
before the call returns) and happens on the event loop thread: in a task, in
the upstream read callback, or in the keepalive timer.  A *unit* (a response
head; one relayed piece of body; a keepalive comment; the end of the message;
an error event with the end of the message) is one method of
:class:`~sidecar.proxy.downstream.Downstream`, written with no ``await`` inside it,
and whatever decides a unit (the scanner's boundary state, the exchange's
state) is read and updated in the same step.  Nothing else can run in between, so
units never interleave and a keepalive never lands inside an event or before
the head; no lock is needed.  ``await`` happens only between units, to wait
out back-pressure (``drain``).

Hot path (a chunked upstream body, i.e. every llama-server stream): when the
client's response is chunked too, the upstream's complete chunks are written
as they arrived (scanned, never decoded and re-encoded); only a chunk split
across reads is decoded and framed again.  Every write therefore ends at a
chunk boundary, so a keepalive comment written between two units is its own
chunk.

Endings: a clean upstream end sends the terminating chunk; an upstream that
dies mid-body leaves the client's response unterminated (the connection is
closed without the last chunk, so the client sees an error instead of a
silently truncated answer); errors before the head become a JSON error
response.  Early open (``--early-open-after S``): for a request that asked to
stream, if no upstream head arrived S seconds after the request was forwarded,
a 200 ``text/event-stream`` head is sent and kept alive; an upstream error then
arrives as one ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import h11

from sidecar.config import Config
from sidecar.core.errors import (
    IO_ERRORS,
    BadRequest,
    ClientDisconnected,
    ClientError,
    SidecarError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from sidecar.core.headers import is_event_stream, response_headers, set_header
from sidecar.core.jsontext import BadText, TextCheck
from sidecar.core.priority import PriorityRules
from sidecar.core.routes import RouteKind, classify
from sidecar.core.stream import StreamMonitor
from sidecar.proxy.downstream import AccessRecord, Downstream, State, error_body
from sidecar.proxy.h11stream import H11Stream
from sidecar.proxy.metrics import Metrics, route_label
from sidecar.proxy.request import (
    RequestPlan,
    apply_priority,
    check_request,
    read_body,
    upstream_headers,
)
from sidecar.proxy.upstream import RequestBody, UpstreamPool, UpstreamResponse

__all__ = ["Context", "Exchange"]

access_log = logging.getLogger("sidecar.access")

MAX_ERROR_BODY = 64 * 1024
# body bytes checked for text (sidecar.core.jsontext) between two yields of the event loop
TEXT_CHECK_STEP = 256 * 1024
# Keepalives are written at 90% of the interval: slack for event-loop lag.
KEEPALIVE_LEAD = 0.1


@dataclass
class Context:
    """State shared by every connection of one sidecar."""

    config: Config
    metrics: Metrics
    upstream: UpstreamPool
    draining: bool = False
    active: int = 0
    clock: Callable[[], float] = time.monotonic
    priority: PriorityRules = field(init=False)
    _idle: anyio.Event | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.priority = self.config.priority_rules

    def exchange_started(self) -> None:
        self.active += 1

    def exchange_ended(self) -> None:
        self.active -= 1
        if self.active == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no exchange is running (the drain)."""
        while self.active:
            self._idle = anyio.Event()
            await self._idle.wait()


async def _check_text(body: RequestBody, request: h11.Request) -> None:
    """A generating body the priority rule reads must be text llama-server parses (400).

    llama-server answers a body that is not UTF-8 or holds a lone surrogate escape with
    a 500; the sidecar, which reads the body anyway, says what is wrong instead.  The
    body is closed when it is refused.
    """
    if classify(request.method, request.target) is not RouteKind.GENERATES:
        return
    check = TextCheck()
    try:
        async for piece in body.paced_pieces(TEXT_CHECK_STEP):
            check.feed(piece)
        check.finish()
    except BadText as exc:
        body.close()
        raise BadRequest(f"a priority rule is on: {exc}") from None
    except BaseException:
        body.close()
        raise


class Exchange:
    def __init__(
        self, ctx: Context, client: H11Stream, request: h11.Request, peer: str | None
    ) -> None:
        self.ctx = ctx
        self.config = cfg = ctx.config
        self.metrics = ctx.metrics
        self.client = client
        self.request = request
        self.peer = peer
        self.clock = ctx.clock
        self.route = route_label(request.target)
        self.rec = AccessRecord(
            request.method.decode("latin-1"), request.target.decode("latin-1", "replace")
        )
        self.monitor = StreamMonitor(
            self.clock(), cfg.park_keepalive, cfg.idle_keepalive, lead=KEEPALIVE_LEAD
        )
        self.out = Downstream(client, self.monitor, self.clock, self.metrics.notice)
        self.plan: RequestPlan | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        # why the exchange stopped early (the client left, a keepalive failed)
        self._error: SidecarError | None = None
        self._loop = asyncio.get_running_loop()
        self._ka_timer: asyncio.TimerHandle | None = None

    @property
    def state(self) -> State:
        return self.out.state

    async def run(self) -> bool:
        """Handle the exchange; True if the client connection may be reused."""
        self.ctx.exchange_started()
        keep_alive = False
        try:
            self.plan = check_request(self.request, self.config)
            body = await self._buffered_body()
            try:
                await self._forward_and_respond(body)
            finally:
                if body is not None:
                    body.close()
            keep_alive = True
        except ClientDisconnected:
            if self.client.stream.send_timed_out:
                # cut off by us (--send-timeout), not gone by itself
                self.rec.outcome = "send_timeout"
                self.metrics.send_timeouts.inc()
            else:
                self.rec.outcome = "client_disconnected"
                self.metrics.disconnect(self.out.phase)
        except ClientError as exc:
            self.rec.outcome = exc.kind
            await self._answer_error(exc.status_hint, str(exc))
        except UpstreamError as exc:
            self._upstream_failed(exc)
            await self._answer_error(exc.status_hint, str(exc))
        except SidecarError as exc:
            self.rec.outcome = exc.kind  # our own failure: the connection loop logs it
            raise
        except anyio.get_cancelled_exc_class():
            # Cancelled from outside (drain timeout, stop): not an "ok" in the log.
            if self.rec.outcome == "ok":
                self.rec.outcome = "cancelled"
            raise
        finally:
            self._stop_keepalive()
            self.ctx.exchange_ended()
            self._record()  # synchronous: cancellation cannot cut it short
        return keep_alive and not self.ctx.draining

    # ------------------------------------------------------------- 1. check

    async def _buffered_body(self) -> RequestBody | None:
        assert self.plan is not None
        try:
            body = await read_body(self.client, self.plan, self.config)
        finally:
            self.rec.bytes_in = self.plan.bytes_in
        cfg = self.config
        if body is not None and self.ctx.priority.active:
            try:
                await _check_text(body, self.request)
            except ClientError:
                self.metrics.priority_requests.labels("refused").inc()
                raise
        try:
            body, outcome, priority = await apply_priority(
                body, self.request, self.plan, self.ctx.priority, cfg.body_buffer
            )
        except ClientError:
            self.metrics.priority_requests.labels("refused").inc()
            raise
        if outcome is not None:
            self.metrics.priority_requests.labels(outcome).inc()
        if priority is not None:
            self.rec.extra["priority"] = priority
        return body

    # ----------------------------------------------------------- 2. forward

    async def _forward_and_respond(self, body: RequestBody | None) -> None:
        headers = upstream_headers(self.request, self.peer, self.config)
        if body is not None:
            headers = set_header(headers, b"Content-Length", b"%d" % body.size)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._watch_client)
            after = self.config.early_open_after
            if after is not None and self.request.method != b"HEAD":
                tg.start_soon(self._early_open_timer, after)
            try:
                self.out.forwarded()
                req = self.request
                try:
                    resp = await self.ctx.upstream.request(req.method, req.target, headers, body)
                except UpstreamError as exc:
                    if self.out.state is not State.EARLY:
                        self.out.answered()
                        raise
                    await self._end_with_error_event(error_body(exc.status_hint, str(exc)))
                    self._upstream_failed(exc)
                else:
                    try:
                        await self._respond(resp)
                    finally:
                        with anyio.CancelScope(shield=True):
                            await resp.aclose()
            except SidecarError as exc:
                self._error = exc
            finally:
                tg.cancel_scope.cancel()
                self._stop_keepalive()
        if self._error is not None:
            raise self._error

    # ----------------------------------------------------------- 3. respond

    async def _respond(self, resp: UpstreamResponse) -> None:
        self.metrics.upstream_up.set(1)
        head = resp.head
        early = self.out.state is State.EARLY
        self.out.answered()
        if early:
            sse = 200 <= head.status < 300 and is_event_stream(head.headers)
            self.monitor.answered(self.clock(), event_stream=sse)
            if not sse:
                await self._early_error_from(resp)
                return
        else:
            self._send_head(head.status, head.reason, head.headers)
        await resp.relay(self.out.piece, self.out.drain)
        self.out.end()
        await self.out.drain()

    def _send_head(self, status: int, reason: bytes, upstream: list[tuple[bytes, bytes]]) -> None:
        """Write the response head downstream (one unit); start the stream's keepalives."""
        headers = response_headers(upstream)
        sse = is_event_stream(headers)
        if sse:
            headers = set_header(headers, b"X-Accel-Buffering", b"no")
            headers = set_header(headers, b"Cache-Control", b"no-cache")
        if self.ctx.draining:
            headers.append((b"Connection", b"close"))
        starts = self.monitor.answered(self.clock(), event_stream=sse)
        self.out.head(h11.Response(status_code=status, headers=headers, reason=reason))
        self.rec.status = status
        if starts:
            self._stream_started()

    async def _watch_client(self) -> None:
        await self.client.wait_for_eof()
        self._client_left()

    def _client_left(self) -> None:
        if self._error is None:
            self._error = ClientDisconnected("client closed the connection")
        assert self._tg is not None
        self._tg.cancel_scope.cancel()

    # -------------------------------------------------- keepalive (a timer)

    def _stream_started(self) -> None:
        self.metrics.stream_started()
        if self.client.body_extensible:
            self._arm_keepalive(self.monitor.next_check(self.clock()))

    def _keepalive_due(self) -> None:
        """Keepalive timer callback: write a comment if one is due, re-arm.

        One ``loop.call_later`` timer per stream instead of a sleeping task:
        thousands of parked streams then cost one heap entry each, and a due
        keepalive is written straight from the callback, so loop lag is all
        that stands between the deadline and the write.  Nothing escapes a
        timer callback (the loop would only log it, and the keepalives would
        stop unseen): a failure ends the exchange instead.
        """
        self._ka_timer = None
        out = self.out
        if not out.open:
            return
        try:
            now = self.clock()
            ka = self.monitor.keepalive_due(now, early_open=out.state is State.EARLY)
            if ka is not None:
                try:
                    out.keepalive(ka.payload)
                except IO_ERRORS:
                    self._client_left()
                    return
                self.metrics.keepalive(ka.reason)
            self._arm_keepalive(self.monitor.next_check(now))
        except Exception as exc:
            self._error = SidecarError(f"keepalive failed: {exc!r}")
            self._error.__cause__ = exc
            if self._tg is not None:
                self._tg.cancel_scope.cancel()

    def _arm_keepalive(self, delay: float) -> None:
        self._ka_timer = self._loop.call_later(delay, self._keepalive_due)

    def _stop_keepalive(self) -> None:
        if self._ka_timer is not None:
            self._ka_timer.cancel()
            self._ka_timer = None

    # ------------------------------------------------------------ early open

    async def _early_open_timer(self, after: float) -> None:
        await anyio.sleep(after)
        assert self.plan is not None
        if self.out.state is not State.QUEUED or not self.plan.wants_stream:
            return
        headers = [
            (b"Content-Type", b"text/event-stream"),
            (b"Cache-Control", b"no-cache"),
            (b"X-Accel-Buffering", b"no"),
        ]
        try:
            self.out.early_head(h11.Response(status_code=200, headers=headers))
        except ClientDisconnected:
            self._client_left()
            return
        self.rec.status = 200
        self.rec.extra["early_open"] = True
        self.monitor.opened_early(self.clock())
        self._stream_started()

    async def _early_error_from(self, resp: UpstreamResponse) -> None:
        status = resp.head.status
        body = await resp.read(MAX_ERROR_BODY)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and "error" in parsed:
            payload: dict[str, Any] = {"error": parsed["error"]}
        elif isinstance(parsed, dict):
            payload = {"error": parsed}
        else:
            payload = error_body(status, body.decode("utf-8", "replace").strip())
        if isinstance(payload["error"], dict):
            payload["error"].setdefault("code", status)
        self.rec.extra["upstream_status"] = status
        await self._end_with_error_event(payload)

    async def _end_with_error_event(self, payload: dict[str, Any]) -> None:
        """After an early open: the upstream error as one event, and the end (one unit)."""
        self.out.error_event(payload)
        self.rec.outcome = "early_open_error"
        await self.out.drain()

    # ------------------------------------------------------------- 4. record

    def _upstream_failed(self, exc: UpstreamError) -> None:
        self.rec.outcome = "upstream_" + exc.kind
        self.metrics.upstream_errors.labels(exc.kind).inc()
        if isinstance(exc, UpstreamConnectError | UpstreamTimeout):
            self.metrics.upstream_up.set(0)

    async def _answer_error(self, status: int, message: str) -> None:
        if await self.out.answer_error(status, message):
            self.rec.status = status

    def _record(self) -> None:
        stats = self.monitor.finish(self.clock())
        rec = self.rec
        rec.duration = stats.duration
        rec.ttfb = stats.ttfb
        rec.bytes_out = stats.bytes_out
        rec.parks = stats.parks
        rec.parked_seconds = stats.parked_seconds
        rec.keepalives = stats.keepalives
        rec.longest_silence = stats.longest_silence
        self.metrics.observe(stats, route=self.route, status=rec.status, bytes_in=rec.bytes_in)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(rec.line())

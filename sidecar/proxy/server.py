"""Listeners, connection loop, drain, and the programmatic entry points.

Theory of operation
-------------------
:class:`Sidecar` binds the proxy listener and the metrics listener, accepts
connections into one task group and runs one connection loop per client,
:func:`serve_connection`: read a request head (idle keep-alive wait, then
``header_timeout`` for the head: a client that sends its headers too slowly gets
408), hand it to a :class:`~sidecar.proxy.relay.Exchange`, and start the next cycle only
when both sides of the h11 connection are ``DONE``.  Malformed heads are answered
with h11's status hint (400, 431, 501) and the connection is closed.  The loop
needs a connected byte stream and the shared :class:`~sidecar.proxy.relay.Context`, no
listener: the tests run it over in-memory streams.

Drain (SIGTERM in the CLI, :meth:`Sidecar.drain` here): ``/ready`` answers
503 from that moment (a balancer stops sending new work), the proxy listener
stops accepting (new connections are refused), idle keep-alive connections are
closed, running exchanges get ``drain_timeout`` seconds to finish, then
everything left is cancelled.  :meth:`Sidecar.stop` (the second signal) ends a
drain that is under way at once.

At the descriptor limit (``EMFILE``, ``ENFILE``) accepting fails until a
connection closes: the listener backs off (``ACCEPT_BACKOFF``, doubling) and
logs once per ``ACCEPT_LOG_EVERY`` seconds with the count of failures, instead
of a line per try.  One descriptor is held in reserve for the metrics listener:
when its accept fails for that reason the reserve is closed and the connection
accepted in its place, so ``/healthz`` and ``/ready`` still answer while the
proxy is full (the reserve is taken back at the next chance).

Programmatic API
----------------
``Sidecar(config, registry=None)``
    ``await sidecar.run(task_status=...)`` serves until drained or cancelled;
    with ``task_group.start(sidecar.run)`` it returns once both listeners are
    bound (``sidecar.url``, ``sidecar.metrics_url`` then hold the real ports,
    so ``listen="127.0.0.1:0"`` works).  ``sidecar.drain()`` starts a graceful
    stop; ``sidecar.stop()`` stops at once, a drain under way included.
``await serve(config, registry=None, *, task_status=...)``
    Shorthand for ``Sidecar(config, registry).run(task_status=...)``.
``await sidecar.serve_client(stream)``, ``await sidecar.serve_metrics_client(stream)``
    One proxy or metrics connection that did not come through a listener, with the
    listener's guard (an error ends that connection only); the stream is closed at the end.
``await serve_connection(ctx, stream, idle=None, started=None)``
    The bare proxy loop over one stream (the caller closes it).

Test helpers (a config on free ports, a sidecar in a thread or a child process) live in
``tests/support/sidecar.py``.
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import logging
import os
import socket
from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Any

import anyio
import anyio.abc
import h11
from anyio.abc import SocketAttribute
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from sidecar.config import Config, format_hostport
from sidecar.core.errors import ClientDisconnected, ClientError
from sidecar.core.headers import get_header
from sidecar.core.readiness import Readiness, Verdict
from sidecar.proxy.downstream import AccessRecord, answer_error, client_side, reason
from sidecar.proxy.h11stream import H11Stream
from sidecar.proxy.metrics import Metrics, RenderLimiter, status_class
from sidecar.proxy.ready_poll import poll_upstream
from sidecar.proxy.relay import Context, Exchange
from sidecar.proxy.transport import TransportStream, accepted
from sidecar.proxy.upstream import UpstreamPool

__all__ = ["Sidecar", "read_head", "serve", "serve_connection"]

log = logging.getLogger("sidecar")
access_log = logging.getLogger("sidecar.access")
# The metrics listener expects no request bodies; a small one is read and dropped.
METRICS_MAX_BODY = 64 * 1024
# accept() at the descriptor limit: first and longest pause between tries, and how often
# the failures are logged
ACCEPT_BACKOFF = (0.05, 1.0)
ACCEPT_LOG_EVERY = 10.0
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class AcceptFailures:
    """One listener's failed accepts: the pause before the next try, and when to log."""

    def __init__(self, log_every: float = ACCEPT_LOG_EVERY) -> None:
        self.log_every = log_every
        self._pause = 0.0
        self._unreported = 0
        self._reported_at: float | None = None

    def failed(self, now: float) -> tuple[float, int]:
        """The pause before the next try, and the failures to log now (0: stay quiet)."""
        self._pause = min(ACCEPT_BACKOFF[1], max(ACCEPT_BACKOFF[0], self._pause * 2))
        self._unreported += 1
        if self._reported_at is not None and now - self._reported_at < self.log_every:
            return self._pause, 0
        self._reported_at = now
        count, self._unreported = self._unreported, 0
        return self._pause, count

    def succeeded(self) -> None:
        self._pause = 0.0


class _Reserve:
    """One descriptor held back, so that the metrics listener can accept at the limit."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.take()

    def take(self) -> None:
        if self.fd is None:
            with suppress(OSError):
                self.fd = os.open(os.devnull, os.O_RDONLY)

    def give_up(self) -> bool:
        if self.fd is None:
            return False
        os.close(self.fd)
        self.fd = None
        return True


def _use_uvloop(config: Config) -> bool:
    """uvloop is opt-in (``--uvloop 1``, ``LLAMA_SIDECAR_UVLOOP=1``) and only if installed.

    docs/benchmarks.md ("Sidecar relay"): no consistent gain over asyncio for
    this workload (less CPU per event, but not reliably lower latency), so the
    default stays on the standard library loop.
    """
    return config.uvloop and importlib.util.find_spec("uvloop") is not None


def _url(addr: tuple[str, int] | None) -> str | None:
    return None if addr is None else "http://" + format_hostport(*addr)


class Sidecar:
    def __init__(
        self,
        config: Config,
        registry: CollectorRegistry | None = None,
        *,
        upstream: UpstreamPool | None = None,
    ) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.ctx = Context(config, self.metrics, upstream or UpstreamPool(config))
        self.address: tuple[str, int] | None = None
        self.metrics_address: tuple[str, int] | None = None
        self._drain_requested: anyio.Event | None = None
        self._drain_timeout = config.drain_timeout
        self._drain_scope: anyio.CancelScope | None = None
        self._idle_scopes: set[anyio.CancelScope] = set()
        self._conns: anyio.abc.TaskGroup | None = None
        self._reserve: _Reserve | None = None
        self.readiness = Readiness(config.ready_poll, config.ready_min_free_kv)
        # scrapes run on the event loop, so the verdict is read with the loop's clock
        self.metrics.ready.set_function(lambda: float(self.ready_verdict().ready))
        self.renders = RenderLimiter()

    @property
    def url(self) -> str:
        url = _url(self.address)
        if url is None:
            raise RuntimeError("sidecar not started")
        return url

    @property
    def metrics_url(self) -> str | None:
        url = _url(self.metrics_address)
        return None if url is None else url + "/metrics"

    def drain(self, timeout: float | None = None) -> None:
        """Stop accepting and let running exchanges finish (call from the loop thread)."""
        if timeout is not None:
            self._drain_timeout = timeout
        if self._drain_requested is not None:
            self.ctx.draining = True  # /ready says 503 from now on
            self._drain_requested.set()

    def stop(self) -> None:
        """Stop now: before a drain, or cutting one short (call from the loop thread)."""
        self.drain(0.0)
        if self._drain_scope is not None:
            self._drain_scope.cancel()

    def ready_verdict(self) -> Verdict:
        """What ``/ready`` answers now: never ready once a drain started."""
        if self.ctx.draining:
            return Verdict(False, "draining (shutting down)")
        return self.readiness.verdict(anyio.current_time())

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[Sidecar] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self._drain_requested = anyio.Event()
        self._reserve = _Reserve()
        host, port = self.config.listen_addr
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port, backlog=1024)
        self.address = _bound(listener)
        mlistener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None
        maddr = self.config.metrics_addr
        if maddr is not None:
            mlistener = await anyio.create_tcp_listener(local_host=maddr[0], local_port=maddr[1])
            self.metrics_address = _bound(mlistener)
        try:
            async with anyio.create_task_group() as conns:
                self._conns = conns
                accept_scope = anyio.CancelScope()
                conns.start_soon(self._accept_loop, listener, self._handle_client, accept_scope)
                metrics_scope = anyio.CancelScope()
                if mlistener is not None:
                    conns.start_soon(
                        self._accept_loop, mlistener, self._handle_metrics, metrics_scope
                    )
                    if self.config.ready_poll > 0:
                        conns.start_soon(self._poll_readiness)
                log.debug(
                    "listening on %s metrics %s upstream %s",
                    self.url,
                    self.metrics_url,
                    self.config.upstream,
                )
                task_status.started(self)
                await self._drain_requested.wait()
                self.ctx.draining = True
                accept_scope.cancel()
                for scope in list(self._idle_scopes):
                    scope.cancel()
                with anyio.move_on_after(self._drain_timeout) as self._drain_scope:
                    await self.ctx.wait_idle()
                conns.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await listener.aclose()
                if mlistener is not None:
                    await mlistener.aclose()
                await self.ctx.upstream.aclose()
                if self._reserve is not None:
                    self._reserve.give_up()

    async def _accept_loop(
        self,
        listener: anyio.abc.Listener[anyio.abc.SocketStream],
        handler: Callable[[TransportStream], Coroutine[Any, Any, None]],
        scope: anyio.CancelScope,
    ) -> None:
        # Accept on the listening sockets ourselves so that connections become
        # TransportStreams (sidecar/proxy/transport.py) rather than anyio SocketStreams.
        socks = [
            inner.extra(SocketAttribute.raw_socket)
            for inner in getattr(listener, "listeners", [listener])
        ]
        with scope:
            async with anyio.create_task_group() as tg:
                for sock in socks:
                    tg.start_soon(
                        self._accept_socket, sock, handler, handler == self._handle_metrics
                    )
        # Closing the listening socket makes new connections fail at once.
        with anyio.CancelScope(shield=True):
            await listener.aclose()

    async def _accept_socket(
        self,
        sock: socket.socket,
        handler: Callable[[TransportStream], Coroutine[Any, Any, None]],
        use_reserve: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        assert self._conns is not None
        assert self._reserve is not None
        reserve = self._reserve
        failures = AcceptFailures()
        while True:
            try:
                client, _ = await loop.sock_accept(sock)
            except asyncio.CancelledError:
                # bpo-41317: a cancelled sock_accept leaves its reader registered.
                with suppress(ValueError, NotImplementedError):
                    loop.remove_reader(sock)
                raise
            except OSError as exc:
                # EMFILE and friends: keep serving the connections we have.
                got = None
                if use_reserve and exc.errno in _OUT_OF_DESCRIPTORS and reserve.give_up():
                    got = _accept_now(sock)  # no await: nobody else takes the descriptor
                    if got is None:
                        reserve.take()
                if got is None:
                    pause, count = failures.failed(loop.time())
                    if count:
                        log.warning(
                            "accept failed on %s: %s (%d time(s) since the last report; "
                            "retrying with back-off, reported every %g s)",
                            _name(sock), exc, count, failures.log_every,
                        )  # fmt: skip
                    await anyio.sleep(pause)
                    reserve.take()
                    continue
                client = got
            failures.succeeded()
            reserve.take()
            try:
                stream = await accepted(client, self.config.send_timeout)
            except OSError:
                client.close()
                continue
            self._conns.start_soon(self._serve_connection, handler, stream)

    async def _serve_connection(
        self,
        handler: Callable[[TransportStream], Coroutine[Any, Any, None]],
        stream: TransportStream,
    ) -> None:
        """Run one connection; whatever goes wrong in it ends that connection only.

        Every connection task runs in the listeners' task group, where one
        escaping exception would cancel every other connection (and end the
        process).  Cancellation still propagates: that is drain and stop.
        """
        try:
            await handler(stream)
        except Exception:
            log.exception("connection failed; closing it")
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            if self._reserve is not None and self._reserve.fd is None:
                # the socket is closed by a callback the close just scheduled: take the
                # freed descriptor back for the reserve right after it, before any accept
                asyncio.get_running_loop().call_soon(self._reserve.take)

    # ------------------------------------------------------------ proxy side

    async def _handle_client(self, stream: TransportStream) -> None:
        await serve_connection(self.ctx, stream, idle=self._idle_scopes)

    async def serve_client(self, stream: TransportStream) -> None:
        """Serve one proxy connection that did not come through the listener.

        The connection loop of the listener's connections runs on ``stream`` (any
        connected :class:`~sidecar.proxy.transport.TransportStream`, a test's in-memory one
        included), with their guard: an error in it ends this connection only.  The
        sidecar's state (metrics, upstream pool, drain) is shared with the listener's.
        """
        await self._serve_connection(self._handle_client, stream)

    async def serve_metrics_client(self, stream: TransportStream) -> None:
        """Serve one metrics connection that did not come through the listener."""
        await self._serve_connection(self._handle_metrics, stream)

    # ---------------------------------------------------------- metrics side

    async def _poll_readiness(self) -> None:
        # runs until the connection task group is cancelled at the end of a drain
        await poll_upstream(self.readiness, self.ctx.upstream)

    async def _handle_metrics(self, stream: TransportStream) -> None:
        """``/metrics``, ``/healthz`` and ``/ready``: GET or HEAD, keep-alive, the proxy's timeouts.

        The connection loop is the proxy side's: ``keepalive_timeout`` for an
        idle keep-alive connection (Prometheus scrapes every minute by default
        and keeps its connection), ``header_timeout`` for a request head,
        ``max_header_bytes`` for its size.  A request body is not expected:
        one that is not complete within ``header_timeout`` or is larger than
        ``METRICS_MAX_BODY`` ends the connection.
        """
        cfg = self.config
        client = H11Stream(stream, h11.SERVER, max_incomplete_event_size=cfg.max_header_bytes)
        try:
            first = True
            while True:
                request = await read_head(client, self.config, first)
                if request is None:
                    return
                if request.method not in (b"GET", b"HEAD"):
                    await answer_error(
                        client, 405, "the metrics listener answers GET and HEAD only",
                        [(b"Allow", b"GET, HEAD")],
                    )  # fmt: skip
                    return
                if not await self._discard_body(client):
                    return
                await self._answer_metrics(client, request)
                if not client.reusable:
                    return
                client.start_next_cycle()
                first = False
        except (ClientError, ClientDisconnected):
            return  # a broken or vanished scraper: nothing to answer
        finally:
            await client.aclose()

    async def _discard_body(self, client: H11Stream) -> bool:
        """Read (and drop) a request body; False if the connection must end."""
        size = 0
        try:
            with anyio.fail_after(self.config.header_timeout), client_side(client):
                while True:
                    event = await client.next_event()
                    if isinstance(event, h11.EndOfMessage):
                        return True
                    if not isinstance(event, h11.Data):
                        return False
                    size += len(event.data)
                    if size > METRICS_MAX_BODY:
                        await answer_error(client, 413, "no request body expected")
                        return False
        except TimeoutError:
            await answer_error(client, 408, "request body not received in time")
            return False
        except ClientError:
            return False

    async def _answer_metrics(self, client: H11Stream, request: h11.Request) -> None:
        path = request.target.split(b"?", 1)[0]
        ctype = b"text/plain; charset=utf-8"
        if path == b"/metrics":
            accept = get_header(request.headers.raw_items(), b"accept") or b""
            encoder, ctype_s = choose_encoder(accept.decode("latin-1"))
            body = self.renders.get(ctype_s, anyio.current_time(), lambda: encoder(self.registry))
            status, ctype = 200, ctype_s.encode()
        elif path == b"/healthz":
            body, status = b"ok\n", 200
        elif path == b"/ready":
            verdict = self.ready_verdict()
            body, status = verdict.body(), 200 if verdict.ready else 503
        else:
            body, status = b"not found: try /metrics, /healthz or /ready\n", 404
        headers = [(b"Content-Type", ctype), (b"Content-Length", str(len(body)).encode())]
        with client_side(client):
            await client.send(
                h11.Response(status_code=status, headers=headers, reason=reason(status))
            )
            if request.method != b"HEAD":
                await client.send_data(body)
            await client.send(h11.EndOfMessage())


# ------------------------------------------------------------ connection loop


async def serve_connection(
    ctx: Context,
    stream: TransportStream,
    *,
    idle: set[anyio.CancelScope] | None = None,
    started: Callable[[Exchange], None] | None = None,
) -> None:
    """The proxy side of one client connection, over any connected byte stream.

    Read a head, run an :class:`~sidecar.proxy.relay.Exchange`, start the next cycle when both
    sides of the h11 connection are ``DONE``; end when the client leaves, a head is
    refused, an exchange ends the connection, or ``ctx`` is draining.  ``idle`` collects
    the cancel scope of the wait for a head (a drain cancels them: idle connections
    close); ``started`` sees each exchange before it runs.  The client address for
    ``X-Forwarded-For`` is the stream's remote address.  The stream is the caller's to
    close.
    """
    cfg = ctx.config
    client = H11Stream(stream, h11.SERVER, max_incomplete_event_size=cfg.max_header_bytes)
    try:
        peer = str(stream.extra(SocketAttribute.remote_address)[0])
    except (anyio.TypedAttributeLookupError, IndexError, TypeError):
        peer = None
    try:
        first = True
        while not ctx.draining:
            request = await read_head(client, cfg, first, idle=idle, metrics=ctx.metrics)
            if request is None:
                break
            exchange = Exchange(ctx, client, request, peer)
            if started is not None:
                started(exchange)
            try:
                keep = await exchange.run()
            except Exception:
                # A bug in one exchange must not take the other streams down.
                log.exception("internal error relaying %r", request.target)
                await answer_error(client, 500, "internal sidecar error")
                break
            if not keep or not client.reusable:
                break
            client.start_next_cycle()
            first = False
    finally:
        await client.aclose()


async def read_head(
    client: H11Stream,
    cfg: Config,
    first: bool,
    *,
    idle: set[anyio.CancelScope] | None = None,
    metrics: Metrics | None = None,
) -> h11.Request | None:
    """The next request head, or None when the connection is to end.

    Waits ``header_timeout`` for the first byte of a new connection and
    ``keepalive_timeout`` on a kept-alive one, then ``header_timeout`` for
    the whole head; malformed, oversized and late heads are answered here
    (counted in ``metrics`` and logged when it is given: proxy requests).  The wait for
    the first byte runs in a cancel scope kept in ``idle`` while it lasts.
    """
    scope = anyio.CancelScope()
    if idle is not None:
        # a drain closes idle proxy connections; the metrics listener's stay, so a
        # balancer's kept-alive health check reads /ready's 503 rather than a reset
        idle.add(scope)
    try:
        with scope:
            wait = cfg.header_timeout if first else cfg.keepalive_timeout
            with anyio.move_on_after(wait):
                if not await client.wait_first_byte():
                    return None
        if scope.cancel_called or (client.bytes_in_cycle == 0 and not client.has_buffered_data()):
            return None  # idle timeout, or draining: close quietly
    finally:
        if idle is not None:
            idle.discard(scope)
    status: int
    try:
        # fail_after outside client_side: TimeoutError is an OSError, which
        # client_side would read as a disconnect.
        with anyio.fail_after(cfg.header_timeout), client_side(client):
            event = await client.next_event()
    except TimeoutError:
        status, message, outcome = (
            408,
            "request headers not received in time",
            "request_timeout",
        )
    except ClientDisconnected:
        return None
    except ClientError as exc:
        status, message, outcome = exc.status_hint, str(exc), exc.kind
    else:
        if not isinstance(event, h11.Request):
            return None  # ConnectionClosed
        # h11 only limits *incomplete* heads; a whole one that arrived in a
        # single read is measured here (bytes consumed so far = the head).
        head_size = client.bytes_in_cycle - len(client.conn.trailing_data[0])
        if head_size > cfg.max_header_bytes:
            status, message, outcome = (
                431, "request header fields too large", "headers_too_large",
            )  # fmt: skip
        elif event.http_version == b"1.0" and _has_te(event):
            # RFC 9112 section 6.1: Transfer-Encoding in an HTTP/1.0 message means
            # faulty framing (a smuggling vector): refused, as nginx does.
            status, message, outcome = (
                400, "Transfer-Encoding in an HTTP/1.0 request", "bad_request",
            )  # fmt: skip
        else:
            return event

    await answer_error(client, status, message)
    if metrics is not None:
        metrics.requests.labels("other", status_class(status)).inc()
        rec = AccessRecord("-", "-", status=status, outcome=outcome)
        access_log.info(rec.line())
    return None


def _bound(listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> tuple[str, int]:
    inner = getattr(listener, "listeners", [listener])[0]
    addr = inner.extra(SocketAttribute.local_address)
    return str(addr[0]), int(addr[1])


async def serve(
    config: Config,
    registry: CollectorRegistry | None = None,
    *,
    task_status: anyio.abc.TaskStatus[Sidecar] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a sidecar until cancelled; ``task_status.started`` gets the :class:`Sidecar`."""
    await Sidecar(config, registry).run(task_status=task_status)


def _has_te(request: h11.Request) -> bool:
    return get_header(request.headers.raw_items(), b"transfer-encoding") is not None


def _accept_now(sock: socket.socket) -> socket.socket | None:
    """A pending connection of a non-blocking listening socket, or None."""
    try:
        client, _ = sock.accept()
    except OSError:
        return None
    client.setblocking(False)
    return client


def _name(sock: socket.socket) -> str:
    try:
        host, port = sock.getsockname()[:2]
    except (OSError, ValueError):
        return "a listener"
    return format_hostport(str(host), int(port))

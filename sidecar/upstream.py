"""Upstream (llama-server) clients: h11 over a small connection pool, or httpx.

Theory of operation
-------------------
The relay needs one operation: send a request with its body (a
:class:`RequestBody`, read in full from the client before this is called),
get the response head, then read the raw body chunk by chunk, and be
able to drop the connection at once (a client that goes away must free its
llama-server slot within 100 ms, which happens when the server sees the socket
close).  :class:`UpstreamClient` is that interface; two implementations exist
so the choice can be made by measurement (see ``docs/benchmarks.md``):

* :class:`H11Upstream` (default): an :class:`~sidecar.adapter.H11Stream` per
  connection and a LIFO pool of idle keep-alive connections.  A pooled
  connection is checked with a non-blocking ``MSG_PEEK`` before reuse, so one
  the server has closed meanwhile is discarded instead of failing a request.
* :class:`HttpxUpstream`: ``httpx.AsyncClient`` streaming with ``aiter_raw``,
  read timeout off (silence is handled by the keepalive ticker), no default
  headers (they would alter the forwarded request, e.g. ``Accept-Encoding``).

Both map their failures to :mod:`sidecar.errors` classes: connect refused ->
``UpstreamConnectError``, connect timeout -> ``UpstreamTimeout``, connection
lost mid-response -> ``UpstreamDisconnected``, garbage -> ``UpstreamProtocolError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.abc
import h11
import httpx
from anyio.abc import SocketAttribute

from sidecar.adapter import H11Stream
from sidecar.chunked import ChunkedDecoder, ChunkedError, whole_chunks
from sidecar.config import Config
from sidecar.errors import (
    PEER_GONE,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from sidecar.headers import Headers, connection_tokens, get_header
from sidecar.transport import TransportStream, connect

__all__ = [
    "H11Upstream",
    "HttpxUpstream",
    "RequestBody",
    "ResponseHead",
    "UpstreamClient",
    "UpstreamResponse",
    "make_upstream",
]


# Interim (1xx) responses accepted before the final one; a flood of them is an error.
MAX_INTERIM = 8


@dataclass(slots=True)
class ResponseHead:
    status: int
    reason: bytes
    headers: Headers
    framing_anomaly: bool = False  # e.g. both Content-Length and Transfer-Encoding


class RequestBody:
    """A request body read in full before upstream is contacted (request buffering).

    Up to ``in_memory`` bytes are held in memory, the rest in an anonymous
    temporary file (``tempfile.SpooledTemporaryFile``), as nginx does with
    ``client_body_buffer_size``.  The body can be sent more than once (a retry
    on a fresh connection) and is sent with a ``Content-Length``.
    """

    __slots__ = ("_file", "size")

    SEND_SIZE = 64 * 1024

    def __init__(self, in_memory: int) -> None:
        self._file = tempfile.SpooledTemporaryFile(max_size=in_memory)  # noqa: SIM115
        self.size = 0

    def append(self, data: bytes) -> None:
        if data:
            self._file.write(data)
            self.size += len(data)

    def pieces(self) -> Iterator[bytes]:
        """The body from the start, in pieces of up to ``SEND_SIZE`` bytes."""
        self._file.seek(0)
        while piece := self._file.read(self.SEND_SIZE):
            yield piece

    async def aiter(self) -> AsyncIterator[bytes]:
        for piece in self.pieces():
            yield piece

    def close(self) -> None:
        self._file.close()


class UpstreamResponse(Protocol):
    head: ResponseHead

    async def receive(self) -> bytes:
        """The next raw body chunk; ``b""`` once the body ended cleanly."""
        ...

    async def aclose(self) -> None:
        """Release the connection: back to the pool if complete, else closed."""
        ...


class UpstreamClient(Protocol):
    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: RequestBody | None,
    ) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


def make_upstream(config: Config) -> UpstreamClient:
    if config.upstream_client == "httpx":
        return HttpxUpstream(config)
    return H11Upstream(config)


# --------------------------------------------------------------------------- h11


def _stray_input(stream: H11Stream) -> bool:
    """True if bytes past the response were received, or the peer closed.

    Between two exchanges an upstream connection must be silent.  Anything
    it sent beyond the end of a response (a body longer than its
    ``Content-Length``, a body after a 204 or a HEAD response, bytes after the
    last chunk) would be read as the *next* client's response: a connection
    with stray bytes is never pooled or reused, whatever they are.
    """
    if stream.has_buffered_data():
        return True
    raw = stream.stream
    # Reading stays enabled on a TransportStream: the loop may have queued them.
    return isinstance(raw, TransportStream) and (raw.at_eof or raw.has_queued)


def _peer_closed(stream: H11Stream) -> bool:
    """Non-blocking check that an idle pooled connection is still open.

    An idle keep-alive connection must have nothing to read: readability means
    EOF (the server closed it) or stray bytes, and either way it is discarded.
    """
    if _stray_input(stream):
        return True
    raw = stream.stream
    try:
        sock = raw.extra(SocketAttribute.raw_socket)
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError, anyio.TypedAttributeLookupError):
        return True
    return bool(readable)


class H11Upstream:
    def __init__(self, config: Config) -> None:
        self.host, self.port, self.base_path = config.upstream_addr
        self.connect_timeout = config.connect_timeout
        self.head_timeout = config.upstream_head_timeout
        self.max_idle = config.upstream_max_idle
        self._idle: list[H11Stream] = []
        self._closed = False

    async def _connect(self) -> H11Stream:
        try:
            with anyio.fail_after(self.connect_timeout):
                sock = await connect(self.host, self.port)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"connect to {self.host}:{self.port} timed out") from exc
        except OSError as exc:
            raise UpstreamConnectError(
                f"cannot connect to upstream {self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
        return H11Stream(sock, h11.CLIENT, max_incomplete_event_size=256 * 1024)

    async def _checkout(self) -> tuple[H11Stream, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not _peer_closed(conn):
                return conn, True
            await conn.aclose()
        return await self._connect(), False

    def _checkin(self, conn: H11Stream, *, fresh: bool = False) -> bool:
        """Pool ``conn`` if its response ended exactly and cleanly; False: close it."""
        if self._closed or len(self._idle) >= self.max_idle or _stray_input(conn):
            return False
        if not fresh:
            if not conn.reusable:
                return False
            conn.start_next_cycle()
        self._idle.append(conn)
        return True

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: RequestBody | None,
    ) -> H11Response:
        if self.base_path:
            target = self.base_path.encode() + target
        for attempt in (0, 1):
            conn, reused = await self._checkout()
            try:
                try:
                    with anyio.fail_after(self.head_timeout):
                        head, chunked = await self._exchange_head(conn, method, target,
                                                                  headers, body)  # fmt: skip
                except TimeoutError as exc:
                    raise UpstreamTimeout(
                        f"upstream sent no response head within {self.head_timeout:g} s"
                    ) from exc
            except UpstreamDisconnected:
                await conn.aclose()
                # A pooled connection the server closed just now: retry once on a
                # fresh one (the body is buffered, so it can be sent again).
                if reused and attempt == 0 and conn.bytes_in_cycle == 0:
                    continue
                raise
            except BaseException:
                await conn.aclose()
                raise
            return H11Response(self, conn, head, chunked)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _exchange_head(
        self,
        conn: H11Stream,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: RequestBody | None,
    ) -> tuple[ResponseHead, bool]:
        """Send the request, read the response head (``head_timeout`` covers both)."""
        try:
            await conn.send(h11.Request(method=method, target=target, headers=headers))
            if body is not None:
                for piece in body.pieces():
                    await conn.send_data(piece)
            await conn.send(h11.EndOfMessage())
        except PEER_GONE as exc:
            raise UpstreamDisconnected("upstream closed while sending request") from exc
        except OSError as exc:
            raise UpstreamDisconnected(f"upstream write failed: {exc}") from exc
        return await _read_head(conn, method)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()


async def _read_head(conn: H11Stream, method: bytes) -> tuple[ResponseHead, bool]:
    """The response head, and whether its body is chunked and decoded by us."""
    for _ in range(MAX_INTERIM + 1):
        event = await _next(conn)
        if isinstance(event, h11.Response):
            head = ResponseHead(event.status_code, event.reason, list(event.headers.raw_items()))
            if (
                get_header(head.headers, b"transfer-encoding") is not None
                and get_header(head.headers, b"content-length") is not None
            ):
                # RFC 9112 section 6.3: Transfer-Encoding wins, but the message
                # "ought to be handled as an error": relay it, never reuse.
                head.framing_anomaly = True
            chunked = (
                method != b"HEAD"
                and event.status_code not in (204, 304)
                and event.http_version == b"1.1"
                and get_header(head.headers, b"transfer-encoding") is not None
                and b"close" not in connection_tokens(head.headers)
            )
            return head, chunked
        if isinstance(event, h11.InformationalResponse):
            continue  # 1xx from upstream: the sidecar answers Expect itself
        raise UpstreamProtocolError(f"unexpected {type(event).__name__} before response")
    raise UpstreamProtocolError(f"more than {MAX_INTERIM} interim (1xx) responses")


async def _next(conn: H11Stream) -> h11.Event:
    try:
        return await conn.next_event()
    except h11.RemoteProtocolError as exc:
        if conn.eof:
            raise UpstreamDisconnected(f"upstream closed the connection: {exc}") from exc
        raise UpstreamProtocolError(f"bad response from upstream: {exc}") from exc


class _BodySink:
    """Decodes a chunked body inside the upstream read callback (see H11Response.relay).

    ``deliver(data)`` gets each decoded piece and returns True when downstream
    is backed up; reading from upstream then pauses until the relay task has
    waited for downstream to drain.  With ``framed=True`` it is called as
    ``deliver(data, wire)``, where ``wire`` is ``data`` in chunked framing made
    mostly of the upstream's own bytes (see :func:`~sidecar.chunked.whole_chunks`),
    or ``None`` when no upstream chunk in the read was whole; a chunked
    downstream writes ``wire`` as it is, sparing a decode and a re-frame per
    event.  Failures (bad framing, upstream gone, a failed delivery) are stored
    and raised by the relay task, never from the callback, so the event loop
    never sees them.
    """

    __slots__ = (
        "_decoder",
        "_deliver",
        "_framed",
        "_loop",
        "_stream",
        "_waiter",
        "blocked",
        "error",
        "finished",
    )

    def __init__(
        self,
        stream: TransportStream,
        decoder: ChunkedDecoder,
        deliver: Callable[..., bool],
        *,
        framed: bool = False,
    ) -> None:
        self._stream = stream
        self._decoder = decoder
        self._deliver = deliver
        self._framed = framed
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self.blocked = False
        self.finished = False
        self.error: BaseException | None = None

    def feed(self, data: bytes) -> None:
        if self.finished:
            self._decoder.feed(data)  # past the end: kept as leftover (no reuse)
            return
        if self.error is not None:
            return
        decoder = self._decoder
        wire: bytes | None = None
        out = b""
        try:
            if self._framed and decoder.idle:
                out, used = whole_chunks(data)
                if used == len(data):
                    wire = data
                elif used:
                    # Whole chunks, then something the decoder has to see (a
                    # partial chunk, the end): forward the first, re-frame the rest.
                    tail = decoder.feed(data[used:])
                    wire = data[:used]
                    if tail:
                        wire += b"%x\r\n%b\r\n" % (len(tail), tail)
                        out += tail
                else:
                    out = decoder.feed(data)
            else:
                out = decoder.feed(data)
        except ChunkedError as exc:
            # The chunks before the bad one are the upstream's answer so far:
            # deliver them (re-framed), then fail.
            good = out + exc.partial
            if good:
                with contextlib.suppress(Exception):
                    if self._framed:
                        self._deliver(good, None)
                    else:
                        self._deliver(good)
            self._fail(UpstreamProtocolError(f"bad chunked body from upstream: {exc}"))
            return
        if out:
            try:
                backed_up = self._deliver(out, wire) if self._framed else self._deliver(out)
            except Exception as exc:
                self._fail(exc)
                return
            if backed_up:
                self.blocked = True
                self._stream.pause_reading()
                self._wake()
        if decoder.done:
            self.finished = True
            self._wake()

    def lost(self, exc: BaseException | None) -> None:
        if not self.finished and self.error is None:
            self._fail(UpstreamDisconnected("upstream closed the connection mid-response"))

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self._stream.pause_reading()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until finished, failed or blocked."""
        if not (self.finished or self.blocked or self.error is not None):
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def unblock(self) -> None:
        self.blocked = False
        self._stream.resume_reading()


class H11Response:
    """Body reader.  ``receive`` returns every body byte already read from the
    socket in one piece: several upstream chunks (one SSE event each, as
    llama-server writes them) that arrived together become one downstream
    write instead of one write per event.  Nothing waits for more data, so
    coalescing adds no latency."""

    __slots__ = (
        "_conn",
        "_decoder",
        "_done",
        "_end_seen",
        "_failed",
        "_pending",
        "_pool",
        "head",
    )

    def __init__(
        self, pool: H11Upstream, conn: H11Stream, head: ResponseHead, chunked: bool = False
    ) -> None:
        self._pool = pool
        self._conn = conn
        self._done = False
        self._end_seen = False
        self._failed: UpstreamProtocolError | None = None
        self.head = head
        # Chunked keep-alive bodies (llama-server's streams) are decoded by the
        # fast ChunkedDecoder; everything else goes through h11.
        self._decoder = ChunkedDecoder() if chunked else None
        self._pending = conn.take_over_body() if chunked else b""

    async def _receive_chunked(self, decoder: ChunkedDecoder) -> bytes:
        if self._failed is not None:
            raise self._failed
        while True:
            if decoder.done:
                self._done = True
                return b""
            if self._pending:
                data, self._pending = self._pending, b""
            else:
                data = await self._conn.receive_raw()
                if not data:
                    raise UpstreamDisconnected("upstream closed the connection mid-response")
            try:
                out = decoder.feed(data)
            except ChunkedError as exc:
                self._failed = UpstreamProtocolError(f"bad chunked body from upstream: {exc}")
                if exc.partial:
                    return exc.partial  # the good chunks first; the error next time
                raise self._failed from exc
            if out:
                return out

    @property
    def can_relay(self) -> bool:
        """True if :meth:`relay` may be used instead of :meth:`receive`."""
        return self._decoder is not None and isinstance(self._conn.stream, TransportStream)

    async def relay(
        self,
        deliver: Callable[[bytes, bytes | None], bool],
        drain: Callable[[], Awaitable[None]],
    ) -> None:
        """Relay the rest of the body from the read callback (the hot path).

        Each decoded piece goes to ``deliver(data, wire)`` straight from
        ``data_received`` (``wire``: see :class:`_BodySink`): no task switch per
        event.  This task only sleeps until the body ends, fails, or ``deliver``
        reported back-pressure (then it awaits ``drain()`` and reading resumes).
        Raises what :meth:`receive` would raise.
        """
        decoder = self._decoder
        stream = self._conn.stream
        assert decoder is not None and isinstance(stream, TransportStream)
        sink = _BodySink(stream, decoder, deliver, framed=True)
        pending = self._pending + stream.set_sink(sink)
        self._pending = b""
        try:
            if pending:
                sink.feed(pending)
            if stream.at_eof:
                sink.lost(None)  # EOF arrived before the sink was installed
            while True:
                await sink.wait()
                if sink.error is not None:
                    raise sink.error
                if sink.finished:
                    self._done = True
                    return
                await drain()
                sink.unblock()
        finally:
            stream.set_sink(None)

    async def receive(self) -> bytes:
        if self._done:
            return b""
        if self._decoder is not None:
            return await self._receive_chunked(self._decoder)
        if self._end_seen:
            self._done = True
            return b""
        event = await _next(self._conn)
        if isinstance(event, h11.Data):
            first = bytes(event.data)
            parts: list[bytes] | None = None
            while True:
                try:
                    more = self._conn.buffered_event()
                except h11.RemoteProtocolError:
                    break  # raised again, mapped, by the next receive()
                if isinstance(more, h11.Data):
                    if parts is None:
                        parts = [first]
                    parts.append(bytes(more.data))
                    continue
                if isinstance(more, h11.EndOfMessage):
                    self._end_seen = True
                break
            return first if parts is None else b"".join(parts)
        if isinstance(event, h11.EndOfMessage):
            self._done = True
            return b""
        if isinstance(event, h11.ConnectionClosed):
            raise UpstreamDisconnected("upstream closed the connection mid-response")
        raise UpstreamProtocolError(f"unexpected {type(event).__name__} in response body")

    async def aclose(self) -> None:
        if self.head.framing_anomaly:
            await self._conn.aclose()
            return
        if self._decoder is not None:
            if self._done and not self._decoder.leftover:
                self._conn.reset()
                if self._pool._checkin(self._conn, fresh=True):
                    return
            await self._conn.aclose()
            return
        if not (self._done and self._pool._checkin(self._conn)):
            await self._conn.aclose()


# --------------------------------------------------------------------------- httpx


class HttpxUpstream:
    def __init__(self, config: Config) -> None:
        self.host, self.port, self.base_path = config.upstream_addr
        self.head_timeout = config.upstream_head_timeout
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=config.connect_timeout, read=None, write=None, pool=None),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=config.upstream_max_idle
            ),
            trust_env=False,
        )

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: RequestBody | None,
    ) -> HttpxResponse:
        url = httpx.URL(
            scheme="http",
            host=self.host,
            port=self.port,
            raw_path=self.base_path.encode() + target,
        )
        fwd = [(n, v) for n, v in headers if n.lower() != b"transfer-encoding"]
        content = None if body is None else body.aiter()
        request = self.client.build_request(
            method.decode("ascii"), url, headers=fwd, content=content
        )
        # httpx adds default headers (Accept-Encoding would change the response).
        given = {n.lower() for n, _ in fwd}
        for name in (b"accept", b"accept-encoding", b"user-agent", b"connection"):
            if name not in given and name.decode() in request.headers:
                del request.headers[name.decode()]
        try:
            with anyio.fail_after(self.head_timeout):
                response = await self.client.send(request, stream=True)
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"upstream sent no response head within {self.head_timeout:g} s"
            ) from exc
        except httpx.ConnectTimeout as exc:
            raise UpstreamTimeout(f"connect to {self.host}:{self.port} timed out") from exc
        except httpx.ConnectError as exc:
            raise UpstreamConnectError(f"cannot connect to upstream: {exc}") from exc
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise UpstreamDisconnected(f"upstream failed: {exc}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamProtocolError(f"upstream failed: {exc}") from exc
        head = ResponseHead(
            response.status_code, response.reason_phrase.encode("latin-1"), response.headers.raw
        )
        return HttpxResponse(response, head)

    async def aclose(self) -> None:
        await self.client.aclose()


class HttpxResponse:
    def __init__(self, response: httpx.Response, head: ResponseHead) -> None:
        self._response = response
        self._iter = response.aiter_raw()
        self.head = head

    async def receive(self) -> bytes:
        try:
            return await anext(self._iter, b"")
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise UpstreamDisconnected(f"upstream closed mid-response: {exc}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamProtocolError(f"upstream failed: {exc}") from exc

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
            await self._response.aclose()

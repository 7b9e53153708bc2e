"""The upstream (llama-server) client: a pool of h11 connections, one body path.

Theory of operation
-------------------
The relay needs one operation: send a request with its body (a
:class:`RequestBody`, read in full from the client before this is called),
get the response head, then have the body delivered piece by piece, and be
able to drop the connection at once (a client that goes away must free its
llama-server slot within 100 ms, which happens when the server sees the
socket close).

* :class:`UpstreamPool` keeps a LIFO list of idle keep-alive connections, each
  an :class:`~sidecar.proxy.h11stream.H11Stream` in the h11 ``CLIENT`` role.  A pooled
  connection is checked for stray input and EOF before reuse, so one the
  server has closed meanwhile is discarded instead of failing a request (and a
  request on a pooled connection that fails before any byte of the answer is
  retried once on a fresh one; the body is buffered).
* h11 writes the request and parses the response head (and its interim 1xx
  responses).  The buffered request body goes out ``SEND_STEP_BYTES`` at a time
  with a yield between steps: a write waits only on a full kernel buffer, which
  an upstream that keeps up never leaves, so a large body would otherwise go out
  in one step of the loop.  The response body is then taken over (raw-body mode
  of the H11Stream) and framed here, by :class:`Framing` (RFC 9112 section
  6.3): none (HEAD, 204, 304), a ``Content-Length``, chunked (decoded by
  :mod:`sidecar.core.chunked`), or until the connection closes.
* **One body path**, push style: :meth:`UpstreamResponse.relay` installs a
  :class:`_BodySink` on the connection's transport, whose ``data_received``
  feeds it; each decoded piece goes straight to the relay's
  ``deliver(data, wire)``, with no task switch per event.  The awaiting task
  only sleeps until the body ends, fails, or ``deliver`` reports that
  downstream is backed up (it then awaits ``drain()`` and reading resumes).
  :meth:`UpstreamResponse.read` (a small error body) is the same path with a
  collecting ``deliver``.
* A connection goes back to the pool only when its response ended exactly:
  HTTP/1.1 without ``Connection: close``, a self-delimited body read to its
  end, and nothing after it (a body longer than its ``Content-Length``, a body
  after a 204, 304 or HEAD response, bytes after the last chunk would be read
  as the *next* client's response), and not both ``Content-Length`` and
  ``Transfer-Encoding``.

Failures map to :mod:`sidecar.core.errors` classes: connect refused ->
``UpstreamConnectError``, connect or head timeout -> ``UpstreamTimeout``,
connection lost mid-response -> ``UpstreamDisconnected``, garbage ->
``UpstreamProtocolError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import select
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import IO

import anyio
import anyio.lowlevel
import h11
from anyio.abc import SocketAttribute

from sidecar.config import Config
from sidecar.core.chunked import ChunkedDecoder, ChunkedError, frame, whole_chunks
from sidecar.core.errors import (
    PEER_GONE,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from sidecar.core.headers import Headers, connection_tokens, get_header
from sidecar.proxy.h11stream import H11Stream
from sidecar.proxy.transport import TransportStream, connect

__all__ = [
    "Deliver",
    "Framing",
    "RequestBody",
    "ResponseHead",
    "UpstreamPool",
    "UpstreamResponse",
]


# Interim (1xx) responses accepted before the final one; a flood of them is an error.
MAX_INTERIM = 8
# Largest response head from upstream, interim responses included: h11 limits only a
# head that is still incomplete, so a whole one is measured as well (see _read_head).
MAX_HEAD = 256 * 1024
# Most header fields in the final response head (nginx's upstream limit is its buffer,
# 4-8 KiB, about a hundred short fields; llama-server sends about ten).
MAX_HEADERS = 100

# deliver(data, wire) -> True when downstream is backed up (see _BodySink)
Deliver = Callable[[bytes, "bytes | None"], bool]
Connect = Callable[[str, int], Awaitable[TransportStream]]


class Framing(enum.Enum):
    """How a response body ends (RFC 9112 section 6.3)."""

    NONE = "none"  # HEAD, 204, 304: no body whatever the head says
    LENGTH = "length"  # Content-Length
    CHUNKED = "chunked"  # Transfer-Encoding: chunked (wins over a Content-Length)
    CLOSE = "close"  # until the server closes the connection


# Request body bytes written upstream before the task yields.  A write waits only while the
# kernel's buffer is full, and an upstream that reads as fast as we write (llama-server's
# HTTP thread, on an idle machine) never fills it: a 30 MiB body went out in one step of the
# loop, about 90 ms of CPU.  1 MiB is about 3 ms.
SEND_STEP_BYTES = 1024 * 1024


@dataclass(slots=True)
class ResponseHead:
    status: int
    reason: bytes
    headers: Headers
    framing: Framing = Framing.CLOSE
    length: int = 0  # with Framing.LENGTH
    keep_alive: bool = False  # HTTP/1.1 without Connection: close
    framing_anomaly: bool = False  # both Content-Length and Transfer-Encoding


class RequestBody:
    """A request body read in full before upstream is contacted (request buffering).

    Up to ``in_memory`` bytes are held in memory, the rest in an anonymous
    temporary file (``tempfile.SpooledTemporaryFile``), as nginx does with
    ``client_body_buffer_size``; ``in_memory=0`` puts every body on disk from
    its first byte (a spooled file with ``max_size=0`` would never roll over:
    0 means "no limit" there).  The body can be sent more than once (a retry
    on a fresh connection) and is sent with a ``Content-Length``.
    """

    __slots__ = ("_file", "size")

    SEND_SIZE = 64 * 1024

    def __init__(self, in_memory: int) -> None:
        self._file: IO[bytes]
        if in_memory > 0:
            self._file = tempfile.SpooledTemporaryFile(max_size=in_memory)  # noqa: SIM115
        else:
            self._file = tempfile.TemporaryFile()  # noqa: SIM115
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

    async def paced_pieces(self, step: int) -> AsyncIterator[bytes]:
        """``pieces()``, with a checkpoint after each ``step`` bytes: a long pass over a large
        body (a check, a splice) lets the other streams run between its steps."""
        done = 0
        for piece in self.pieces():
            yield piece
            done += len(piece)
            if done >= step:
                done = 0
                await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        self._file.close()


def _stray_input(conn: H11Stream) -> bool:
    """True if bytes past the response were received, or the peer closed.

    Between two exchanges an upstream connection must be silent: anything it
    sent would be read as the *next* client's response, so a connection with
    stray bytes is never pooled or reused, whatever they are.  Reading stays
    enabled on a :class:`~sidecar.proxy.transport.TransportStream`, so the loop may
    have queued them already.
    """
    stream = conn.stream
    return conn.has_buffered_data() or stream.at_eof or stream.has_queued


def _peer_closed(conn: H11Stream) -> bool:
    """Non-blocking check that an idle pooled connection is still open.

    An idle keep-alive connection must have nothing to read: readability means
    EOF (the server closed it) or stray bytes, and either way it is discarded.
    The poll sees what the loop has not delivered yet.  ``poll`` rather than
    ``select``: ``select`` refuses descriptors of ``FD_SETSIZE`` (1024) and
    above, and a busy sidecar has those.
    """
    if _stray_input(conn):
        return True
    sock = conn.stream.extra(SocketAttribute.raw_socket, None)
    if sock is None:
        return False  # not a socket (an in-memory transport): at_eof is the truth
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class UpstreamPool:
    def __init__(self, config: Config, *, connect: Connect = connect) -> None:
        self.host, self.port, self.base_path = config.upstream_addr
        self.connect_timeout = config.connect_timeout
        self.head_timeout = config.upstream_head_timeout
        self.max_idle = config.upstream_max_idle
        self._connect_stream = connect
        self._idle: list[H11Stream] = []
        self._closed = False

    async def _connect(self) -> H11Stream:
        try:
            with anyio.fail_after(self.connect_timeout):
                stream = await self._connect_stream(self.host, self.port)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"connect to {self.host}:{self.port} timed out") from exc
        except OSError as exc:
            raise UpstreamConnectError(
                f"cannot connect to upstream {self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
        return H11Stream(stream, h11.CLIENT, max_incomplete_event_size=MAX_HEAD)

    async def _checkout(self) -> tuple[H11Stream, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not _peer_closed(conn):
                return conn, True
            await conn.aclose()
        return await self._connect(), False

    def _checkin(self, conn: H11Stream) -> bool:
        """Pool ``conn`` (reset after its response); False: the caller closes it."""
        if self._closed or len(self._idle) >= self.max_idle or _stray_input(conn):
            return False
        self._idle.append(conn)
        return True

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: RequestBody | None,
    ) -> UpstreamResponse:
        if self.base_path:
            target = self.base_path.encode() + target
        for attempt in (0, 1):
            conn, reused = await self._checkout()
            try:
                try:
                    with anyio.fail_after(self.head_timeout):
                        head = await _exchange_head(conn, method, target, headers, body)
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
            return UpstreamResponse(self, conn, head)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()


async def _exchange_head(
    conn: H11Stream,
    method: bytes,
    target: bytes,
    headers: Headers,
    body: RequestBody | None,
) -> ResponseHead:
    """Send the request, read the response head (``head_timeout`` covers both)."""
    try:
        conn.write_event(h11.Request(method=method, target=target, headers=headers))
        if body is not None:
            # paced: an upstream that reads as fast as we write never makes a write wait
            async for piece in body.paced_pieces(SEND_STEP_BYTES):
                await conn.send_data(piece)
        await conn.send(h11.EndOfMessage())
    except PEER_GONE as exc:
        raise UpstreamDisconnected("upstream closed while sending request") from exc
    except OSError as exc:
        raise UpstreamDisconnected(f"upstream write failed: {exc}") from exc
    return await _read_head(conn, method)


async def _read_head(conn: H11Stream, method: bytes) -> ResponseHead:
    """The final response head, its body framing, and whether the connection may be kept."""
    for _ in range(MAX_INTERIM + 1):
        event = await _next(conn)
        if isinstance(event, h11.Response):
            # Bytes consumed so far: every head of this exchange, whatever the read sizes.
            size = conn.bytes_in_cycle - len(conn.conn.trailing_data[0])
            if size > MAX_HEAD:
                raise UpstreamProtocolError(f"upstream response head over {MAX_HEAD} bytes")
            if len(event.headers) > MAX_HEADERS:
                raise UpstreamProtocolError(
                    f"upstream response head has more than {MAX_HEADERS} header fields"
                )
            return _head(event, method)
        if isinstance(event, h11.InformationalResponse):
            continue  # 1xx from upstream: the sidecar answers Expect itself
        raise UpstreamProtocolError(f"unexpected {type(event).__name__} before response")
    raise UpstreamProtocolError(f"more than {MAX_INTERIM} interim (1xx) responses")


def _head(event: h11.Response, method: bytes) -> ResponseHead:
    headers = list(event.headers.raw_items())
    head = ResponseHead(event.status_code, event.reason, headers)
    te = get_header(headers, b"transfer-encoding")
    cl = get_header(headers, b"content-length")
    # RFC 9112 section 6.3: Transfer-Encoding wins over Content-Length, but the
    # message "ought to be handled as an error": relay it, never reuse.
    head.framing_anomaly = te is not None and cl is not None
    if method == b"HEAD" or event.status_code in (204, 304):
        head.framing = Framing.NONE
    elif te is not None:
        head.framing = Framing.CHUNKED  # h11 accepts no other coding
    elif cl is not None:
        head.framing, head.length = Framing.LENGTH, int(cl)  # validated by h11
    head.keep_alive = (
        event.http_version == b"1.1"
        and head.framing is not Framing.CLOSE
        and not head.framing_anomaly
        and b"close" not in connection_tokens(headers)
    )
    return head


async def _next(conn: H11Stream) -> h11.Event:
    try:
        return await conn.next_event()
    except h11.RemoteProtocolError as exc:
        if conn.eof:
            raise UpstreamDisconnected(f"upstream closed the connection: {exc}") from exc
        raise UpstreamProtocolError(f"bad response from upstream: {exc}") from exc


class _BodySink:
    """Frames a response body inside the upstream read callback (see UpstreamResponse.relay).

    ``deliver(data, wire)`` gets each decoded piece and returns True when
    downstream is backed up; reading from upstream then pauses until the relay
    task has waited for downstream to drain.  ``wire`` is ``data`` in chunked
    framing made mostly of the upstream's own bytes (see
    :func:`~sidecar.core.chunked.whole_chunks`), or ``None`` when no upstream chunk
    in the read was whole or the body is not chunked; a chunked downstream
    writes ``wire`` as it is, sparing a decode and a re-frame per event.
    Failures (bad framing, upstream gone, a failed delivery) are stored and
    raised by the relay task, never from the callback, so the event loop never
    sees them.  Bytes past the end of the body set :attr:`overrun` (the
    connection is then not reused).
    """

    __slots__ = (
        "_chunked",
        "_decoder",
        "_deliver",
        "_framing",
        "_loop",
        "_remaining",
        "_stream",
        "_waiter",
        "blocked",
        "error",
        "finished",
        "overrun",
    )

    def __init__(self, stream: TransportStream, head: ResponseHead, deliver: Deliver) -> None:
        self._stream = stream
        self._framing = head.framing
        self._chunked = head.framing is Framing.CHUNKED  # an enum lookup costs ~0.15 us
        self._decoder = ChunkedDecoder()
        self._remaining = head.length
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self.blocked = False
        self.finished = head.framing is Framing.NONE or (
            head.framing is Framing.LENGTH and head.length == 0
        )
        self.overrun = False
        self.error: BaseException | None = None

    def feed(self, data: bytes) -> None:
        if self.finished:
            self.overrun = self.overrun or bool(data)
            return
        if self.error is not None:
            return
        wire: bytes | None = None
        if not self._chunked:
            out = self._counted(data)
        else:
            # Chunked (every llama-server stream): the hot path, kept in this function.
            decoder = self._decoder
            out = b""
            try:
                if decoder.idle:
                    out, used = whole_chunks(data)
                    if used == len(data):
                        wire = data
                    elif used:
                        # Whole chunks, then something the decoder has to see (a
                        # partial chunk, the end): forward the first, re-frame the rest.
                        tail = decoder.feed(data[used:])
                        wire = data[:used] + frame(tail)
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
                        self._deliver(good, None)
                self._fail(UpstreamProtocolError(f"bad chunked body from upstream: {exc}"))
                return
            if decoder.done:
                self.finished = True
                self.overrun = bool(decoder.leftover)
        if out:
            try:
                backed_up = self._deliver(out, wire)
            except Exception as exc:
                self._fail(exc)
                return
            if backed_up:
                self.blocked = True
                self._stream.pause_reading()
                self._wake()
        if self.finished:
            self._wake()

    def _counted(self, data: bytes) -> bytes:
        """The body bytes of ``data`` for a ``Content-Length`` or close-delimited body."""
        if self._framing is Framing.LENGTH:
            if len(data) >= self._remaining:
                self.overrun = len(data) > self._remaining
                data = data[: self._remaining]
                self._remaining = 0
                self.finished = True
            else:
                self._remaining -= len(data)
        return data

    def lost(self, exc: BaseException | None) -> None:
        if self.finished or self.error is not None:
            return
        if self._framing is Framing.CLOSE:
            self.finished = True  # the end of a close-delimited body
            self._wake()
            return
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


class _Enough(Exception):
    """Stops :meth:`UpstreamResponse.read` once it holds ``limit`` bytes."""


async def _stop_reading() -> None:
    raise _Enough


class UpstreamResponse:
    """The response head, and its body delivered by :meth:`relay` (once)."""

    __slots__ = ("_conn", "_done", "_overrun", "_pending", "_pool", "head")

    def __init__(self, pool: UpstreamPool, conn: H11Stream, head: ResponseHead) -> None:
        self._pool = pool
        self._conn = conn
        self._done = False
        self._overrun = False
        self.head = head
        self._pending = conn.take_over_body()

    async def relay(self, deliver: Deliver, drain: Callable[[], Awaitable[None]]) -> None:
        """Deliver the body from the read callback until it ends (the one body path).

        Raises ``UpstreamDisconnected`` if the connection ends mid-body,
        ``UpstreamProtocolError`` for bad framing (after delivering the good
        chunks before it), or what ``deliver`` / ``drain`` raised.
        """
        stream = self._conn.stream
        sink = _BodySink(stream, self.head, deliver)
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
            self._overrun = sink.overrun
            stream.set_sink(None)

    async def read(self, limit: int) -> bytes:
        """The body, or its first ``limit`` bytes (for a small error body)."""
        parts: list[bytes] = []
        size = 0

        def collect(data: bytes, wire: bytes | None) -> bool:
            nonlocal size
            parts.append(data)
            size += len(data)
            return size >= limit  # "backed up": relay() then calls _stop_reading

        with contextlib.suppress(_Enough):
            await self.relay(collect, _stop_reading)
        return b"".join(parts)[:limit]

    async def aclose(self) -> None:
        """Back to the pool if the response ended exactly, else close the connection."""
        conn = self._conn
        if self._done and self.head.keep_alive and not self._overrun:
            conn.reset()
            if self._pool._checkin(conn):
                return
        await conn.aclose()

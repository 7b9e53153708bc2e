"""The one class that touches an ``h11.Connection``: :class:`H11Stream`.

Theory of operation
-------------------
Modelled on h11's ``examples/trio-server.py`` (``TrioHTTPWrapper``) and
httpcore's ``_async/http11.py``: an :class:`H11Stream` pairs one
``h11.Connection`` with one :class:`~sidecar.proxy.transport.TransportStream` and is
used for both roles (the client side of the sidecar is an h11 ``SERVER``, the
upstream side an h11 ``CLIENT``).

* :meth:`next_event` loops on ``NEED_DATA``, reading from the socket; a peer
  that closes is fed to h11 as ``b""`` so h11 decides whether that was a clean
  end (``ConnectionClosed``) or a truncated message (``RemoteProtocolError``;
  :attr:`eof` then tells the caller the peer went away).
* **Writes** are synchronous: :meth:`write_event` and :meth:`write_data` hand
  the bytes to the transport at once and never yield, so a unit that is
  written by one call (or by several calls with no ``await`` between them)
  reaches the peer whole, whatever else runs on the loop.  :meth:`drain` waits
  for back-pressure; :meth:`send` and :meth:`send_data` are a write followed by
  that wait.  When a write raises, ``send_failed()`` is called so h11 knows
  the connection is dead.
* **Raw-body mode**: h11 parses every head, but a body may be taken over
  (:meth:`take_over_body`): h11 is then no longer fed for this message, the
  caller reads raw bytes and decodes the framing itself (upstream response
  bodies, chunked request bodies; see :mod:`sidecar.core.chunked`).  :attr:`raw_body`
  says so; :meth:`reset` leaves the mode with a fresh state machine (the
  upstream pool does that once a response ended exactly).  A server-role
  connection whose request body was taken over is not :attr:`reusable`.
* :meth:`reusable` / :meth:`start_next_cycle`: a connection is reused only when
  both sides are ``DONE`` (``MUST_CLOSE`` is honoured by closing).
* **Obsolete line folding** in a request head (a header line that starts with
  a space or a tab) is refused with 400 before h11 parses the head: h11
  unfolds it silently, and RFC 9112 section 5.2 lets a server either reject it
  or replace it; rejecting keeps a folded line from meaning one thing here and
  another upstream.
* :meth:`wait_for_eof` is the client-disconnect watcher's read: after the
  request is complete, any bytes read (pipelined requests) are handed to h11,
  which buffers them for the next cycle; end of stream means the client left.

The class performs no locking; the ordering rule for the writes of one
exchange is stated once, in :mod:`sidecar.proxy.relay`.  Errors escape as h11 /
anyio / OSError exceptions; callers translate them with
:func:`sidecar.core.errors.map_exceptions` because only they know which side is at
fault.
"""

from __future__ import annotations

import re

import anyio
import h11

from sidecar.core.chunked import ChunkedDecoder, frame
from sidecar.core.errors import PEER_GONE
from sidecar.proxy.transport import TransportStream

__all__ = ["READ_SIZE", "H11Stream"]

READ_SIZE = 64 * 1024
# Pipelined bytes buffered while a response is streaming; beyond this they are
# read and dropped (and the connection closes after the response), so that a
# disconnect is still seen, in bounded memory.
MAX_PIPELINED = 64 * 1024
_CHUNKED_HEAD = b"\r\ntransfer-encoding: chunked\r\n"
# The end of a head as h11 finds it, and a line of it that starts with a space or a tab.
_HEAD_END = re.compile(rb"\n\r?\n")
_OBS_FOLD = re.compile(rb"\n[ \t]")


class H11Stream:
    __slots__ = (
        "_chunked_out",
        "_max_incomplete",
        "_raw_pending",
        "_request_method",
        "_server",
        "bytes_in_cycle",
        "conn",
        "discarding",
        "eof",
        "framing_out",
        "raw_body",
        "stream",
    )

    def __init__(
        self,
        stream: TransportStream,
        role: type[h11.CLIENT] | type[h11.SERVER],
        *,
        max_incomplete_event_size: int = 16 * 1024,
    ) -> None:
        self.stream = stream
        self._max_incomplete = max_incomplete_event_size
        self.conn = h11.Connection(role, max_incomplete_event_size=max_incomplete_event_size)
        self.eof = False
        self.discarding = False  # pipelined input overflowed and is dropped (see wait_for_eof)
        self.raw_body = False  # this message's body is read past h11 (take_over_body)
        self._raw_pending = memoryview(b"")
        self.bytes_in_cycle = 0
        self._chunked_out = False  # our current message body is chunked (see send)
        # How our current response body is framed: "chunked", "length" (a
        # Content-Length), "close" (HTTP/1.0: until the connection closes) or
        # "none" (HEAD, 204, 304); see body_extensible.
        self.framing_out = "none"
        self._request_method = b""  # of the request being answered (server role)
        self._server = role is h11.SERVER

    async def _receive(self) -> bytes:
        try:
            data = await self.stream.receive(READ_SIZE)
        except PEER_GONE:
            data = b""
        except OSError:
            data = b""
        if not data:
            self.eof = True
        self.bytes_in_cycle += len(data)
        return data

    async def next_event(self) -> h11.Event:
        """The next h11 event, reading as needed (never returns ``NEED_DATA``)."""
        conn = self.conn
        while True:
            if self._server and conn.their_state is h11.IDLE:
                _refuse_obs_fold(conn)
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self._receive())
                continue
            if event is h11.PAUSED:
                raise h11.LocalProtocolError("next_event() called while paused")
            assert isinstance(event, h11.Event)
            if type(event) is h11.Request:
                self._request_method = event.method
            return event

    async def next_body_piece(self, max_events: int) -> tuple[bytes, bool]:
        """The body bytes of the next read, in one piece, and whether the message ended.

        h11 returns one ``Data`` event per chunk, so a read full of tiny chunks
        is thousands of events: at most ``max_events`` are parsed per call (the
        rest stays in h11's buffer for the next call), and the pieces are joined
        so the caller handles one ``bytes`` per call, not one per chunk.  Waits
        for a read only when nothing is buffered; the caller yields between
        calls.  Raises ``h11.RemoteProtocolError`` for a malformed or truncated
        body (check :attr:`eof`).
        """
        conn = self.conn
        parts: list[bytes] = []
        for _ in range(max_events):
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if parts:
                    break
                conn.receive_data(await self._receive())
                continue
            if type(event) is h11.Data:
                parts.append(event.data)
            elif type(event) is h11.EndOfMessage:
                return b"".join(parts), True
            else:
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in a body")
        return b"".join(parts), False

    async def next_chunked_piece(
        self, decoder: ChunkedDecoder, max_bytes: int
    ) -> tuple[bytes, bool]:
        """:meth:`next_body_piece` for a chunked request body, decoded by ``decoder``.

        h11 costs about 13 us per chunk, :class:`~sidecar.core.chunked.ChunkedDecoder`
        about 2.5: a body of one-byte chunks is the cheapest way to make a
        server work, so it is decoded here, ``max_bytes`` of wire bytes per call.
        The first call takes the body over from h11 (see :meth:`take_over_body`);
        h11 never sees its end, so the connection is not :attr:`reusable`
        afterwards (it closes after the response).  Raises ``ChunkedError`` for
        bad framing and ``h11.RemoteProtocolError`` if the peer closes mid-body.
        """
        if not self.raw_body:
            self._raw_pending = memoryview(self.take_over_body())
        if not self._raw_pending:
            data = await self._receive()
            if not data:
                raise h11.RemoteProtocolError("peer closed the connection mid-body")
            self._raw_pending = memoryview(data)
        piece = bytes(self._raw_pending[:max_bytes])
        self._raw_pending = self._raw_pending[max_bytes:]
        out = decoder.feed(piece)
        if decoder.done:
            self._raw_pending = memoryview(b"")  # pipelined bytes: dropped with the connection
        return out, decoder.done

    def buffered_event(self) -> h11.Event | None:
        """The next event if it can be parsed from bytes already read, else None (no I/O)."""
        event = self.conn.next_event()
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return None
        assert isinstance(event, h11.Event)
        return event

    def take_over_body(self) -> bytes:
        """Enter raw-body mode: the rest of this message is the caller's to read.

        Returns what h11 has buffered past the head; the caller then reads the
        socket (or installs a sink on :attr:`stream`) and decodes the framing
        itself (see :mod:`sidecar.core.chunked`).  h11 is no longer fed for this
        cycle; :meth:`reset` gives a fresh state machine for the next one.
        """
        self.raw_body = True
        data, _closed = self.conn.trailing_data
        return bytes(data)

    def reset(self) -> None:
        """Leave raw-body mode with a fresh h11 state machine for the next message."""
        self.conn = h11.Connection(
            self.conn.our_role, max_incomplete_event_size=self._max_incomplete
        )
        self.raw_body = False
        self.bytes_in_cycle = 0

    def has_buffered_data(self) -> bool:
        """True if bytes of the next message are already buffered (pipelining)."""
        return bool(self.conn.trailing_data[0])

    async def wait_first_byte(self) -> bool:
        """Wait until some byte of the next message is available; False at EOF."""
        if self.has_buffered_data():
            return True
        data = await self._receive()
        self.conn.receive_data(data)
        return bool(data)

    def write_event(self, event: h11.Event) -> None:
        """Write an h11 event (a head, an end of message) now, without waiting."""
        data = self.conn.send(event)
        if type(event) is h11.Response:
            self.framing_out = self._framing(event, data)
            self._chunked_out = self.framing_out == "chunked"
        elif type(event) is h11.EndOfMessage:
            self._chunked_out = False
            self.framing_out = "none"
        if data:
            self._write(data)

    async def send(self, event: h11.Event) -> None:
        """:meth:`write_event`, then wait out back-pressure."""
        self.write_event(event)
        await self.drain()

    def _framing(self, event: h11.Response, head: bytes | None) -> str:
        if self._request_method == b"HEAD" or event.status_code in (204, 304):
            # RFC 9112 section 6.3: no body, whatever the head says (h11 writes
            # a HEAD response's framing fields as if it were a GET's).
            return "none"
        head = (head or b"").lower()
        # h11 writes these fields exactly as it frames the body (our header
        # filter drops any Transfer-Encoding from upstream).
        if _CHUNKED_HEAD in head:
            return "chunked"
        if b"\r\ncontent-length:" in head:
            return "length"
        return "close"

    @property
    def body_extensible(self) -> bool:
        """True if bytes may be added to our response body (keepalive comments).

        Only a chunked or a close-delimited body: a ``Content-Length`` counts
        the upstream's bytes exactly, and a HEAD, 204 or 304 response has none.
        """
        return self.framing_out in ("chunked", "close")

    def write_data(self, data: bytes, wire: bytes | None = None) -> None:
        """Write a piece of the message body now, without waiting.

        When our body is chunked it is framed here (:func:`~sidecar.core.chunked.frame`,
        as h11's writer would, without an h11 event per write on the hot path),
        unless ``wire`` is given: ``data`` already in complete canonical chunks,
        as the upstream framed it, which is written as it stands.
        """
        if self._chunked_out:
            out = wire if wire is not None else frame(data)
        else:
            out = self.conn.send(h11.Data(data=data)) or b""
        if out:
            try:  # _write, inlined: this is the hot path
                self.stream.write(out)
            except BaseException:
                self._chunked_out = False
                self.conn.send_failed()
                raise

    async def send_data(self, data: bytes) -> None:
        """:meth:`write_data`, then wait out back-pressure."""
        self.write_data(data)
        await self.drain()

    def _write(self, data: bytes) -> None:
        try:
            self.stream.write(data)
        except BaseException:
            self._chunked_out = False
            self.conn.send_failed()
            raise

    @property
    def backed_up(self) -> bool:
        """True while written bytes wait for the kernel buffer (see :meth:`drain`)."""
        return self.stream.write_paused

    async def drain(self) -> None:
        """Wait until the bytes written so far have reached the kernel."""
        if self.stream.write_paused:
            await self.stream.drain()

    async def wait_for_eof(self) -> None:
        """Return when the peer closes.

        Pipelined bytes go to h11's buffer for the next cycle, up to
        ``MAX_PIPELINED``.  Past that they are read and dropped, and the
        connection is no longer :attr:`reusable` (the requests in them are
        lost, so it must close after this response): reading never stops, so
        end of stream is seen whatever the client sends, in bounded memory.
        """
        while True:
            data = await self._receive()
            if not data:
                return
            if self.discarding:
                continue
            if len(self.conn.trailing_data[0]) + len(data) > MAX_PIPELINED:
                self.discarding = True
                continue
            self.conn.receive_data(data)

    @property
    def reusable(self) -> bool:
        return (
            self.conn.our_state is h11.DONE
            and self.conn.their_state is h11.DONE
            and not self.discarding
            and not self.raw_body
        )

    def start_next_cycle(self) -> None:
        self.conn.start_next_cycle()
        self.bytes_in_cycle = 0

    async def aclose(self) -> None:
        """Close the socket now; bounded and shielded so cancellation cannot skip it."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
            try:
                await self.stream.aclose()
            except PEER_GONE:
                pass
            except OSError:
                pass


def _refuse_obs_fold(conn: h11.Connection) -> None:
    """Raise 400 if the request head buffered in ``conn`` is whole and has an obs-fold."""
    data = conn.trailing_data[0]
    end = _HEAD_END.search(data)
    if end is not None and _OBS_FOLD.search(data, 0, end.start() + 1):
        raise h11.RemoteProtocolError(
            "obsolete line folding (a header line starting with a space or tab)",
            error_status_hint=400,
        )

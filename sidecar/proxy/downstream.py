"""The client's side of an exchange: its state, the writer of its response, the access record.

Theory of operation
-------------------
* :class:`State` is where an exchange is, one value for the whole of it (as h11
  keeps ``our_state``); :class:`Downstream` holds it and is the one writer of the
  response, which it counts as it writes (each body piece is fed to the
  exchange's :class:`~sidecar.core.stream.StreamMonitor`).  Each write unit (a head,
  the early-open head, a body piece, a keepalive comment, the end, an error
  event with the end, an error answer) is one method that checks the state,
  writes with no ``await`` inside, and moves the state; a unit the state does
  not allow raises :class:`StateError` before a byte is written.  The moves
  that are no write (the request forwarded, upstream's answer) are methods
  too, so no other code sets the state::

      REQUEST --forwarded--> QUEUED --early_head--> EARLY
      QUEUED --answered--> ANSWERED --head--> RESPONSE --end--> DONE
      EARLY --answered--> RESPONSE (our head stands for upstream's)
      EARLY, RESPONSE --error_event--> DONE
      REQUEST, QUEUED, ANSWERED --answer_error--> DONE

* :func:`client_side` translates what talking to the client may raise (h11,
  anyio and socket errors) into :mod:`sidecar.core.errors` classes; a message the
  client cut short is a disconnect, not a bad request.
* :func:`answer_error` is every error response the sidecar makes itself: JSON
  in llama-server's shape (``{"error": {"code", "message", "type"}}``), the
  standard reason phrase, ``Connection: close``, and only while nothing of a
  response was sent yet.
* :class:`AccessRecord` is the one structured access-log line per request.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import Any

import anyio
import h11

from sidecar.core.errors import (
    IO_ERRORS,
    BadRequest,
    ClientDisconnected,
    ClientError,
    map_exceptions,
)
from sidecar.core.headers import Headers
from sidecar.core.stream import NoticeSeen, Phase, StreamMonitor
from sidecar.proxy.h11stream import H11Stream

__all__ = [
    "AccessRecord",
    "Downstream",
    "State",
    "StateError",
    "answer_error",
    "client_side",
    "error_body",
    "reason",
]

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


def error_body(status: int, message: str) -> dict[str, Any]:
    """llama-server's error shape, with a ``type`` chosen by status."""
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
    body = json.dumps(error_body(status, message)).encode()
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
        client.write_event(h11.Response(status_code=status, headers=head, reason=reason(status)))
        client.write_data(body)
        await client.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        return False
    except IO_ERRORS:
        return False
    return True


class State(enum.Enum):
    """Where an exchange is."""

    REQUEST = "request"  # reading and checking the request
    QUEUED = "queued"  # forwarded; upstream has not answered, nothing sent downstream
    EARLY = "early"  # our early-open head is out; upstream has not answered
    ANSWERED = "answered"  # upstream answered (a head or a failure); nothing sent yet
    RESPONSE = "response"  # upstream answered and a head is out: body pieces, keepalives
    DONE = "done"  # the end of the message is out


class StateError(RuntimeError):
    """A write unit or a move that the exchange's state does not allow (a bug, not input)."""


# Before upstream answers, the state is the phase; after, the monitor's bytes tell it.
_PHASE = {State.REQUEST: Phase.REQUEST, State.QUEUED: Phase.QUEUED, State.EARLY: Phase.QUEUED}
_RESPONSE = State.RESPONSE  # the body piece's check, without an attribute lookup


class Downstream:
    """The state of one exchange and the one writer of its response to the client.

    ``monitor`` counts what is written; ``notice`` gets the park notices a body
    piece completes (the live metrics).
    """

    __slots__ = ("client", "clock", "monitor", "notice", "state")

    def __init__(
        self,
        client: H11Stream,
        monitor: StreamMonitor,
        clock: Callable[[], float],
        notice: Callable[[NoticeSeen], None],
    ) -> None:
        self.client = client
        self.monitor = monitor
        self.clock = clock
        self.notice = notice
        self.state = State.REQUEST

    def _require(self, *states: State, unit: str) -> None:
        if self.state not in states:
            raise StateError(f"{unit} in exchange state {self.state.value}")

    @property
    def head_sent(self) -> bool:
        """A head is out: an error can no longer be answered with a response of its own."""
        return self.state in (State.EARLY, State.RESPONSE, State.DONE)

    @property
    def open(self) -> bool:
        """A response is out and not ended: keepalives may be written."""
        return self.state is State.EARLY or self.state is State.RESPONSE

    @property
    def phase(self) -> Phase:
        """Where the exchange is, as a client disconnect is labelled."""
        return _PHASE.get(self.state) or self.monitor.phase

    # ----------------------------------------------------- moves, no write

    def forwarded(self) -> None:
        """The request goes upstream."""
        self._require(State.REQUEST, unit="forwarding")
        self.state = State.QUEUED

    def answered(self) -> None:
        """Upstream answered (a head, or a failure instead of one)."""
        self._require(State.QUEUED, State.EARLY, unit="an answer")
        self.state = State.RESPONSE if self.state is State.EARLY else State.ANSWERED

    # --------------------------------------------------------- write units

    def head(self, response: h11.Response) -> None:
        """Upstream's head, as the client gets it."""
        self._require(State.ANSWERED, unit="a head")
        with client_side(self.client):
            self.client.write_event(response)
        self.state = State.RESPONSE

    def early_head(self, response: h11.Response) -> None:
        """Our own event-stream head, before upstream answered."""
        self._require(State.QUEUED, unit="an early head")
        with client_side(self.client):
            self.client.write_event(response)
        self.state = State.EARLY

    def piece(self, data: bytes, wire: bytes | None) -> bool:
        """One relayed piece of the body, from the upstream read callback.

        ``wire`` is ``data`` in whole chunks as upstream framed them; a chunked
        downstream gets those bytes unchanged.  Returns True when the client is
        backed up (the relay task then drains before reading on).
        """
        if self.state is not _RESPONSE:
            self._require(State.RESPONSE, unit="a body piece")
        seen = self.monitor.feed(data, self.clock())
        if seen:
            for notice in seen:
                self.notice(notice)
        client = self.client
        try:
            client.write_data(data, wire)
        except Exception:
            # Translate only on the error path: a context manager per piece costs.
            with client_side(client):
                raise
        return client.stream.write_paused  # client.backed_up, inlined: the hot path

    def keepalive(self, payload: bytes) -> None:
        """A keepalive comment; raises what the transport raises (the client is gone)."""
        self._require(State.EARLY, State.RESPONSE, unit="a keepalive")
        self.client.write_data(payload)

    def end(self) -> None:
        """The end of the message."""
        self._require(State.RESPONSE, unit="an end")
        with client_side(self.client):
            self.client.write_event(h11.EndOfMessage())
        self.state = State.DONE

    def error_event(self, payload: dict[str, Any]) -> None:
        """After an early open: upstream's failure as one ``data:`` event, and the end."""
        self._require(State.EARLY, State.RESPONSE, unit="an error event")
        event = b"data: " + json.dumps(payload).encode() + b"\n\n"
        with client_side(self.client):
            self.client.write_data(event)
            self.client.write_event(h11.EndOfMessage())
        self.state = State.DONE

    async def answer_error(self, status: int, message: str) -> bool:
        """A JSON error response, unless a head is out already; True if it was written."""
        if self.head_sent:
            return False
        if not await answer_error(self.client, status, message):
            return False
        self.state = State.DONE
        return True

    async def drain(self) -> None:
        """Wait out back-pressure (between units, never inside one)."""
        with client_side(self.client):
            await self.client.drain()


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

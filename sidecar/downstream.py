"""The client's side of an exchange: failure translation, error answers, the access record.

Theory of operation
-------------------
* :func:`client_side` translates what talking to the client may raise (h11,
  anyio and socket errors) into :mod:`sidecar.errors` classes; a message the
  client cut short is a disconnect, not a bad request.
* :func:`answer_error` is every error response the sidecar makes itself: JSON
  in llama-server's shape (``{"error": {"code", "message", "type"}}``), the
  standard reason phrase, ``Connection: close``, and only while nothing of a
  response was sent yet.
* :class:`AccessRecord` is the one structured access-log line per request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import Any

import anyio
import h11

from sidecar.adapter import H11Stream
from sidecar.errors import IO_ERRORS, BadRequest, ClientDisconnected, ClientError, map_exceptions
from sidecar.headers import Headers

__all__ = ["AccessRecord", "answer_error", "client_side", "error_body", "reason"]

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

"""The sidecar's error hierarchy, with an HTTP status hint per class.

Theory of operation
-------------------
Like ``httpx._exceptions``: a small documented tree, raised deep inside the
I/O code and translated to a response only at the edges (the connection loop
answers ``status_hint`` with a JSON body).  :func:`map_exceptions` turns the
foreign exceptions of a block (h11, anyio, OSError) into these classes so the
rest of the code catches only ``SidecarError`` subclasses.

::

    SidecarError (500)
    +-- ClientError (400)             the request is at fault; answer and close
    |   +-- BadRequest (400)          malformed request, conflicting framing
    |   +-- Unauthorized (401)        --api-key mismatch
    |   +-- Forbidden (403)           a route a priority rule cannot reach
    |   +-- RequestTimeout (408)      headers or body too slow
    |   +-- PayloadTooLarge (413)     body over --max-body
    |   +-- UnsupportedMediaType (415)  a body a priority rule cannot reach
    |   +-- HeadersTooLarge (431)     request head over the limit
    |   +-- UnsupportedFraming (501)  unknown transfer coding
    |   +-- MethodNotSupported (501)  CONNECT (the sidecar is no tunnel)
    +-- ClientDisconnected            the client went away (an expected ending)
    +-- UpstreamError (502)           llama-server is at fault
        +-- UpstreamConnectError (502)   connect refused / unreachable
        +-- UpstreamTimeout (504)        no answer within the connect timeout
        +-- UpstreamProtocolError (502)  unparseable response
        +-- UpstreamDisconnected (502)   connection lost mid-response
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import anyio
import h11

__all__ = [
    "BadRequest",
    "ClientDisconnected",
    "ClientError",
    "Forbidden",
    "HeadersTooLarge",
    "MethodNotSupported",
    "PayloadTooLarge",
    "RequestTimeout",
    "SidecarError",
    "Unauthorized",
    "UnsupportedFraming",
    "UnsupportedMediaType",
    "UpstreamConnectError",
    "UpstreamDisconnected",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamTimeout",
    "client_error_for_status",
    "map_exceptions",
]


class SidecarError(Exception):
    """Base class; ``status_hint`` is the status to answer if nothing was sent yet."""

    status_hint = 500
    kind = "internal"


class ClientError(SidecarError):
    status_hint = 400
    kind = "bad_request"


class BadRequest(ClientError):
    pass


class Unauthorized(ClientError):
    status_hint = 401
    kind = "unauthorized"


class Forbidden(ClientError):
    status_hint = 403
    kind = "forbidden"


class RequestTimeout(ClientError):
    status_hint = 408
    kind = "request_timeout"


class PayloadTooLarge(ClientError):
    status_hint = 413
    kind = "payload_too_large"


class UnsupportedMediaType(ClientError):
    status_hint = 415
    kind = "unsupported_media_type"


class HeadersTooLarge(ClientError):
    status_hint = 431
    kind = "headers_too_large"


class UnsupportedFraming(ClientError):
    status_hint = 501
    kind = "not_implemented"


class MethodNotSupported(ClientError):
    status_hint = 501
    kind = "not_implemented"


class ClientDisconnected(SidecarError):
    """The client closed its connection; not answered, only counted."""

    status_hint = 499
    kind = "client_disconnected"


class UpstreamError(SidecarError):
    status_hint = 502
    kind = "upstream"


class UpstreamConnectError(UpstreamError):
    kind = "connect"


class UpstreamTimeout(UpstreamError):
    status_hint = 504
    kind = "timeout"


class UpstreamProtocolError(UpstreamError):
    kind = "protocol"


class UpstreamDisconnected(UpstreamError):
    kind = "disconnect"


_BY_STATUS: dict[int, type[ClientError]] = {
    400: BadRequest,
    401: Unauthorized,
    408: RequestTimeout,
    413: PayloadTooLarge,
    431: HeadersTooLarge,
    501: UnsupportedFraming,
}


def client_error_for_status(status: int) -> type[ClientError]:
    return _BY_STATUS.get(status, ClientError)


ExcMapping = Mapping[type[BaseException], type[SidecarError]]


@contextmanager
def map_exceptions(mapping: ExcMapping) -> Iterator[None]:
    """Re-raise foreign exceptions as the mapped :class:`SidecarError` subclass.

    ``h11.RemoteProtocolError`` mapped to a ``ClientError`` keeps its
    ``error_status_hint`` (400, 431 or 501) by picking the matching subclass.
    """
    try:
        yield
    except SidecarError:
        raise
    except Exception as exc:
        for from_exc, to_exc in mapping.items():
            if isinstance(exc, from_exc):
                if issubclass(to_exc, ClientError) and isinstance(exc, h11.ProtocolError):
                    to_exc = client_error_for_status(exc.error_status_hint)
                raise to_exc(str(exc) or type(exc).__name__) from exc
        raise


# Peer-gone conditions seen on a socket, for mappings.
PEER_GONE: tuple[type[BaseException], ...] = (
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    ConnectionError,
)
IO_ERRORS: tuple[type[BaseException], ...] = (*PEER_GONE, OSError)

"""The request half of an exchange: checks, request buffering, the head for upstream.

Theory of operation
-------------------
Before anything is forwarded, :func:`check_request` looks at the request head:
conflicting framing (both ``Content-Length`` and ``Transfer-Encoding``, RFC
9112 section 6.1: reject and close), ``CONNECT``, a declared body over
``--max-body``, ``--api-key``.  Its :class:`RequestPlan` says how the body is
framed and whether the client asked to stream.

:func:`read_body` then reads the whole request body before upstream is
contacted, as nginx's request buffering does: a slow or stalled upload holds a
sidecar connection (cheap), never a llama-server HTTP thread.  The body has
``--body-timeout`` seconds in all (408), at most ``--max-body`` bytes (413);
``Expect: 100-continue`` is answered once the checks passed.  The work between
two yields of the loop is bounded, so a body of tiny chunks cannot hold it.

:func:`apply_priority` writes the operator's ``priority`` into a completion
body (:mod:`sidecar.priority`); :func:`upstream_headers` is the head that goes
upstream: hop-by-hop fields removed, ``X-Forwarded-For``/``-Proto`` added.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import anyio.to_thread
import h11

from sidecar.adapter import H11Stream
from sidecar.chunked import ChunkedDecoder, ChunkedError
from sidecar.config import Config
from sidecar.downstream import client_side
from sidecar.errors import (
    BadRequest,
    MethodNotSupported,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
)
from sidecar.headers import REQUEST_DROP, Headers, filter_headers, get_header, set_header
from sidecar.priority import PRIORITY_ROUTES, PriorityRules, with_priority
from sidecar.upstream import RequestBody

__all__ = ["RequestPlan", "apply_priority", "check_request", "read_body", "upstream_headers"]

# Routes answered without --api-key, like llama-server's own public endpoints.
PUBLIC_ROUTES = frozenset({b"/health", b"/v1/health"})
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
# Work per step of reading a request body before the task yields (see read_body):
# h11 events of a Content-Length body, and wire bytes of a chunked one (decoded by
# ChunkedDecoder); either is about a millisecond when every chunk holds one byte.
BODY_EVENTS_PER_STEP = 64
CHUNKED_STEP_BYTES = 4096
# bodies larger than this get their priority set on a worker thread (JSON parse and dump)
PRIORITY_INLINE_PARSE = 256 * 1024


@dataclass
class RequestPlan:
    """What the checks learned from the head, and what reading the body added."""

    chunked: bool  # a chunked request body (decoded by us; the connection closes after)
    has_body: bool
    key_given: str | None  # the API key the client sent, if any
    wants_stream: bool  # Accept: text/event-stream, or "stream": true in the body
    bytes_in: int = 0
    _stream_tail: bytes = b""

    def saw(self, data: bytes) -> None:
        """Body bytes read: count them, and look for ``"stream": true``."""
        self.bytes_in += len(data)
        if data and not self.wants_stream:
            scan = self._stream_tail + data
            self.wants_stream = _STREAM_TRUE.search(scan) is not None
            self._stream_tail = scan[-32:]


def check_request(request: h11.Request, config: Config) -> RequestPlan:
    """Refuse what must not be forwarded (a ClientError); else the plan for the body."""
    raw = list(request.headers.raw_items())
    te = get_header(raw, b"transfer-encoding")
    cl = get_header(raw, b"content-length")
    if te is not None and cl is not None:
        # RFC 9112 section 6.1: may reject, and must close afterwards.
        raise BadRequest("both Content-Length and Transfer-Encoding present")
    if request.method == b"CONNECT":
        # A tunnel, not a request to relay (RFC 9110 section 9.3.6).
        raise MethodNotSupported("CONNECT is not supported")
    if cl is not None and int(cl) > config.max_body:
        raise PayloadTooLarge(f"request body of {int(cl)} bytes exceeds {config.max_body}")
    auth = get_header(raw, b"authorization") or b""
    given = auth[7:].strip() if auth[:7].lower() == b"bearer " else None
    given = given or get_header(raw, b"x-api-key")
    key = config.api_key
    public = request.target.split(b"?", 1)[0] in PUBLIC_ROUTES
    if key and not public and (given is None or not hmac.compare_digest(given, key.encode())):
        raise Unauthorized("invalid or missing API key")
    accept = get_header(raw, b"accept") or b""
    return RequestPlan(
        chunked=te is not None,
        has_body=te is not None or (cl is not None and int(cl) > 0),
        key_given=None if given is None else given.decode("latin-1"),
        wants_stream=b"text/event-stream" in accept.lower(),
    )


def upstream_headers(request: h11.Request, peer: str | None, config: Config) -> Headers:
    """The request head for upstream; the body (if any) gets its Content-Length later."""
    headers = filter_headers(request.headers.raw_items(), REQUEST_DROP)
    if peer:
        prior = get_header(headers, b"x-forwarded-for")
        addr = peer.encode()
        headers = set_header(headers, b"X-Forwarded-For", prior + b", " + addr if prior else addr)
    if get_header(headers, b"x-forwarded-proto") is None:
        headers.append((b"X-Forwarded-Proto", b"http"))
    if get_header(headers, b"host") is None:
        host, port, _ = config.upstream_addr
        headers.append((b"Host", f"{host}:{port}".encode()))
    return headers


async def read_body(client: H11Stream, plan: RequestPlan, config: Config) -> RequestBody | None:
    """The whole request body (None if there is none), read before upstream is contacted.

    Up to ``body_buffer`` bytes stay in memory, the rest goes to a temporary
    file.  A chunked body is decoded by :class:`~sidecar.chunked.ChunkedDecoder`
    (five times cheaper per chunk than h11) and its connection closes after
    the response.
    """
    if not plan.has_body:
        with client_side(client):
            event = await client.next_event()
        if not isinstance(event, h11.EndOfMessage):
            raise BadRequest("unexpected request body")
        return None
    body = RequestBody(config.body_buffer)
    try:
        with anyio.fail_after(config.body_timeout):
            await _fill(client, plan, body, config.max_body)
    except TimeoutError:
        body.close()
        raise RequestTimeout("request body not received in time") from None
    except BaseException:
        body.close()
        raise
    return body


async def _fill(client: H11Stream, plan: RequestPlan, body: RequestBody, limit: int) -> None:
    with client_side(client):
        if client.conn.they_are_waiting_for_100_continue:
            # RFC 9110 section 10.1.1: the checks passed, so go ahead.
            await client.send(h11.InformationalResponse(status_code=100, headers=[]))
        decoder = ChunkedDecoder() if plan.chunked else None
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
            plan.saw(data)
            if end:
                return
            await anyio.lowlevel.checkpoint()  # one read's work, then the others


async def apply_priority(
    body: RequestBody | None,
    request: h11.Request,
    plan: RequestPlan,
    rules: PriorityRules,
    in_memory: int,
) -> tuple[RequestBody | None, str | None, int | None]:
    """The body with the operator's ``priority`` set where it applies.

    Returns the body to forward, the outcome (``"set"``, ``"unparsed"``, or
    None when no rule applies) and the priority set.  Only JSON completion
    bodies, and only once a priority rule is configured; a body that does not
    parse as a JSON object goes through unchanged.  A large body is parsed on
    a worker thread so that the event loop keeps serving.
    """
    route = request.target.split(b"?", 1)[0]
    if body is None or not rules.active or request.method != b"POST":
        return body, None, None
    if route not in PRIORITY_ROUTES:
        return body, None, None
    header = get_header(request.headers.raw_items(), rules.header) if rules.header else None
    priority = rules.priority_for(plan.key_given, header)
    if body.size > PRIORITY_INLINE_PARSE:
        # reading it back (from the temporary file past --body-buffer) happens there too
        rewritten = await anyio.to_thread.run_sync(_rewrite, body, priority)
    else:
        rewritten = _rewrite(body, priority)
    if rewritten is None:
        return body, "unparsed", None
    body.close()
    body = RequestBody(in_memory)
    body.append(rewritten)
    return body, "set", priority


def _rewrite(body: RequestBody, priority: int) -> bytes | None:
    return with_priority(b"".join(body.pieces()), priority)

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

:func:`apply_priority` gives a request that llama-server would run as a
generation the operator's ``priority`` (:mod:`sidecar.core.routes` says which,
:mod:`sidecar.core.priority` splices the field in), or refuses it; the body is
scanned and copied ``SPLICE_STEP_BYTES`` at a time with a yield between steps,
so a large body holds the event loop no longer than a small one.
:func:`upstream_headers` is the head that goes upstream: hop-by-hop fields
removed, ``X-Forwarded-For``/``-Proto`` added.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import h11

from sidecar.config import Config
from sidecar.core.chunked import ChunkedDecoder, ChunkedError
from sidecar.core.errors import (
    BadRequest,
    Forbidden,
    MethodNotSupported,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    UnsupportedMediaType,
)
from sidecar.core.headers import REQUEST_DROP, Headers, filter_headers, get_header, set_header
from sidecar.core.priority import NotAnObject, PriorityRules, PrioritySplice
from sidecar.core.routes import RouteKind, classify, normalise_path
from sidecar.proxy.downstream import client_side
from sidecar.proxy.h11stream import H11Stream
from sidecar.proxy.upstream import RequestBody

__all__ = ["RequestPlan", "apply_priority", "check_request", "read_body", "upstream_headers"]

# Routes answered without --api-key, like llama-server's own public endpoints.
PUBLIC_ROUTES = frozenset({b"/health", b"/v1/health"})
# llama-server's web UI: the page and its static files (the bundle under /_app/, icons, the
# manifest, the service worker) load without the key, as llama-server serves them with its own
# --api-key; the page then asks for the key (its key prompt) and sends it with every API call.
# A file name with an extension, no `..` and no %-escape: never one of llama-server's API routes.
_UI_ASSET = re.compile(rb"/(?:index\.html)?|/_app/[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*"
                       rb"|/[A-Za-z0-9_-][A-Za-z0-9_.-]*\.(?:js|css|html|json|png|svg|ico|webmanifest)")


def public_route(method: bytes, target: bytes) -> bool:
    """Whether a request needs no API key: /health, or a GET/HEAD of the web UI's files."""
    path = target.split(b"?", 1)[0]
    if path in PUBLIC_ROUTES:
        return True
    return (method in (b"GET", b"HEAD") and b".." not in path
            and _UI_ASSET.fullmatch(path) is not None)  # fmt: skip
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
# Work per step of reading a request body before the task yields (see read_body):
# h11 events of a Content-Length body, and wire bytes of a chunked one (decoded by
# ChunkedDecoder); either is about a millisecond when every chunk holds one byte.
BODY_EVENTS_PER_STEP = 64
CHUNKED_STEP_BYTES = 4096
# Body bytes the priority splice scans (or copies) before the task yields: C-speed scans
# of 64 KiB pieces, about 2 ms of CPU at most (30-70 ms for a whole 30 MiB body).
SPLICE_STEP_BYTES = 1024 * 1024


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
    public = public_route(request.method, request.target)
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
    file.  A chunked body is decoded by :class:`~sidecar.core.chunked.ChunkedDecoder`
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
    """The body with the operator's ``priority`` set where it applies, or a ClientError.

    Returns the body to forward, the outcome (``"set"``, or None when no rule
    applies) and the priority set.  Once a rule is active, a POST that
    llama-server would run as a generation gets the priority spliced into its
    body; one that cannot be given it is refused, not forwarded: a path that
    needs normalising (400), a route llama-server's table does not have or one
    whose handler drops the field (403),
    a multipart or content-encoded body (415), a body that is not a JSON object
    (400).  ``body`` is closed when another is returned and when a refusal is
    raised.
    """
    if not rules.active:
        return body, None, None
    kind = classify(request.method, request.target)
    if kind is RouteKind.OTHER:
        return body, None, None
    try:
        _refuse_unreachable(kind, request)
        if body is None:
            raise BadRequest("a priority rule is on: the body must be a JSON object")
        header = get_header(request.headers.raw_items(), rules.header) if rules.header else None
        priority = rules.priority_for(plan.key_given, header)
        spliced = await _splice(body, priority, in_memory)
    except BaseException:
        if body is not None:
            body.close()
        raise
    body.close()
    return spliced, "set", priority


def _refuse_unreachable(kind: RouteKind, request: h11.Request) -> None:
    """Raise for a POST whose generation the priority could not reach."""
    target = request.target
    if kind is RouteKind.UNNORMALISED:
        shown = normalise_path(target).decode("latin-1", "replace")
        raise BadRequest(
            f"a priority rule is on: POST paths must be sent as they are, without "
            f"%-escapes or a fragment (llama-server reads this one as {shown!r})"
        )
    if kind is RouteKind.DROPS_PRIORITY:
        path = target.split(b"?", 1)[0].decode("latin-1", "replace")
        raise Forbidden(
            f"a priority rule is on: llama-server drops the priority of a POST {path} "
            f"request (it keeps only the fields it converts), so the sidecar refuses it"
        )
    if kind is RouteKind.UNKNOWN:
        path = target.split(b"?", 1)[0].decode("latin-1", "replace")
        raise Forbidden(
            f"a priority rule is on: POST {path} is not a llama-server route the "
            f"sidecar knows, so it cannot give it a priority"
        )
    for name, value in request.headers:
        # llama-server reads a multipart form's fields, or inflates a compressed body, where
        # the spliced field is not
        if name == b"content-type" and b"multipart" in value.lower():
            raise UnsupportedMediaType(
                "a priority rule is on: the body must be a JSON object, not a multipart form"
            )
        if name == b"content-encoding" and value.strip().lower() != b"identity":
            raise UnsupportedMediaType(
                "a priority rule is on: the body must be a JSON object without a Content-Encoding"
            )


async def _splice(body: RequestBody, priority: int, in_memory: int) -> RequestBody:
    """A copy of ``body`` with the priority spliced in; two passes in bounded steps."""
    splice = PrioritySplice()
    async for piece in body.paced_pieces(SPLICE_STEP_BYTES):
        splice.feed(piece)
    try:
        at, text = splice.finish(priority)
    except NotAnObject as exc:
        raise BadRequest(f"a priority rule is on: {exc}") from None
    out = RequestBody(in_memory)
    try:
        offset = 0
        async for piece in body.paced_pieces(SPLICE_STEP_BYTES):
            if offset <= at < offset + len(piece):
                cut = at - offset
                out.append(piece[:cut])
                out.append(text)
                out.append(piece[cut:])
            else:
                out.append(piece)
            offset += len(piece)
    except BaseException:
        out.close()
        raise
    return out

"""llama-server's routes, as its HTTP layer sees them: which ones generate.

Theory of operation
-------------------
A priority rule (:mod:`sidecar.core.priority`) must reach every request that llama-server runs
as a generation, whatever spelling of the path reached it.  llama-server's HTTP library
cuts the request target at the first ``#``, splits the query off at the first ``?``,
percent-decodes the path (``%XX``, and the old ``%uXXXX`` form too) and then compares it
with its route table, literally and case-sensitively, for POST only.  So
``/v1/chat/completion%73``, ``/v1/chat%2Fcompletions``, ``/v1/chat/completions#x`` and
``/completio%u006e`` all reach a completion handler.

:func:`normalise_path` does what that library does, so the spelling a client chose can be
compared with the table here; :func:`classify` says what a request is to the priority
rule.  While a rule is on, the sidecar refuses a POST whose path needs normalising at all
(no client of the API needs ``%`` or ``#`` in a route), and a POST to a path that is not
in the table (the Vertex AI prediction route, for one, which dispatches to any route from
inside its body, and whatever a later llama-server adds), and a POST to a generating route
whose handler drops the body's ``priority`` (:data:`PRIORITY_DROPPED`): a request it
cannot give the priority is not forwarded.

The table is kept here and nowhere else.  ``tests/hostile/test_priority_bypass.py`` reads
the route registrations of the pinned llama-server source and fails when a route is
missing here or a handler that generates is not in :data:`GENERATING_ROUTES`.
Everything here is pure: no I/O.
"""

from __future__ import annotations

import enum
import re

__all__ = [
    "GENERATING_ROUTES", "OTHER_POST_ROUTES", "PRIORITY_DROPPED", "RouteKind", "classify",
    "needs_normalising", "normalise_path",
]  # fmt: skip

# POST routes whose handler runs a generation (a completion task): the bodies that must
# carry the operator's priority.  The transcription routes take multipart forms, which the
# sidecar cannot give a priority: while a rule is on they are refused (a body that is not a
# JSON object).
GENERATING_ROUTES = frozenset({
    b"/completion", b"/completions", b"/v1/completions",
    b"/chat/completions", b"/v1/chat/completions",
    b"/v1/responses", b"/responses",
    b"/v1/messages",
    b"/infill",
    b"/v1/audio/transcriptions", b"/audio/transcriptions",
})  # fmt: skip

# Generating routes whose handler drops a body's "priority" before the task is made:
# llama-server's Anthropic Messages conversion builds a new body from the fields it knows.
# The priority cannot reach these, so while a rule is on they are refused.
PRIORITY_DROPPED = frozenset({b"/v1/messages"})

# POST routes that do not generate (embeddings, rerank and token counting run no
# completion; control acts on a running one; the rest are administration), relayed as
# they are.  A route with a ``:name`` segment matches any one segment there.
OTHER_POST_ROUTES = frozenset({
    b"/props",
    b"/v1/chat/completions/control",
    b"/embedding", b"/embeddings", b"/v1/embeddings",
    b"/rerank", b"/reranking", b"/v1/rerank", b"/v1/reranking",
    b"/tokenize", b"/detokenize", b"/apply-template",
    b"/chat/completions/input_tokens", b"/v1/chat/completions/input_tokens",
    b"/responses/input_tokens", b"/v1/responses/input_tokens",
    b"/v1/messages/count_tokens",
    b"/lora-adapters",
    b"/slots/:id_slot",
    b"/v1/streams/lookup",
    b"/models", b"/models/load", b"/models/unload",
    b"/cors-proxy",
    b"/tools",
})  # fmt: skip

_PERCENT = re.compile(rb"%(?:u([0-9A-Fa-f]{4})|([0-9A-Fa-f]{2}))")


class RouteKind(enum.Enum):
    GENERATES = "generates"  # a POST to a generating route: gets the priority
    DROPS_PRIORITY = "drops_priority"  # a generating route that loses a body's priority
    OTHER = "other"  # a known route that does not generate, or not a POST
    UNKNOWN = "unknown"  # a POST to a path the table does not have
    UNNORMALISED = "unnormalised"  # a POST whose path needs normalising


def _decode(match: re.Match[bytes]) -> bytes:
    wide, byte = match.groups()
    if byte is not None:
        return bytes([int(byte, 16)])
    code = int(wide, 16)
    # %uXXXX: the code point in UTF-8; the library drops a surrogate (it writes nothing)
    return b"" if 0xD800 <= code < 0xE000 else chr(code).encode()


def normalise_path(target: bytes) -> bytes:
    """The path llama-server routes ``target`` by: fragment and query cut off, decoded.

    One pass, as llama-server's HTTP library does it: ``%2541`` is ``%41``, not ``A``; a
    ``%`` not followed by two hex digits (or ``u`` and four) stays as it is.
    """
    path = target.split(b"#", 1)[0].split(b"?", 1)[0]
    return _PERCENT.sub(_decode, path) if b"%" in path else path


def needs_normalising(target: bytes) -> bool:
    """Whether llama-server would route ``target`` by another spelling than its own path.

    True for a fragment, any ``%`` in the path, and a target that is not in origin form
    (``/...``: an absolute URL or ``*``).
    """
    path = target.split(b"?", 1)[0]
    return b"#" in target or b"%" in path or not path.startswith(b"/")


def _matches(route: bytes, path: bytes) -> bool:
    if b"/:" not in route:
        return route == path
    want, got = route.split(b"/"), path.split(b"/")
    return len(want) == len(got) and all(
        w == g or (w.startswith(b":") and g != b"") for w, g in zip(want, got, strict=True)
    )


def classify(method: bytes, target: bytes) -> RouteKind:
    """What a request is to the priority rule (see the module's docstring)."""
    if method != b"POST":
        return RouteKind.OTHER  # llama-server generates for POST only (HEAD is a GET there)
    if needs_normalising(target):
        return RouteKind.UNNORMALISED
    path = target.split(b"?", 1)[0]
    if path in PRIORITY_DROPPED:
        return RouteKind.DROPS_PRIORITY
    if path in GENERATING_ROUTES:
        return RouteKind.GENERATES
    if any(_matches(route, path) for route in OTHER_POST_ROUTES):
        return RouteKind.OTHER
    return RouteKind.UNKNOWN

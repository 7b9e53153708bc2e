"""llama-server's routes as the priority rule sees them (sidecar/core/routes.py), by table."""

from __future__ import annotations

import pytest

from sidecar.core.routes import (
    GENERATING_ROUTES,
    OTHER_POST_ROUTES,
    PRIORITY_DROPPED,
    RouteKind,
    classify,
    needs_normalising,
    normalise_path,
)


@pytest.mark.parametrize(
    ("target", "want"),
    [
        (b"/v1/chat/completions", b"/v1/chat/completions"),
        (b"/v1/chat/completion%73", b"/v1/chat/completions"),
        (b"/v1/chat%2Fcompletions", b"/v1/chat/completions"),
        (b"/v1/chat%2fcompletions", b"/v1/chat/completions"),  # either case of hex digit
        (b"/v1/chat/completions#x", b"/v1/chat/completions"),
        (b"/v1/chat/completions#x?y", b"/v1/chat/completions"),  # the fragment goes first
        (b"/v1/chat/completions?a=%41#x", b"/v1/chat/completions"),
        (b"/completio%u006e", b"/completion"),  # the old %uXXXX form
        (b"/completio%U006e", b"/completio%U006e"),  # ... with a lower-case u only
        (b"/x%u00e9", "/x\u00e9".encode()),  # decoded to UTF-8
        (b"/x%ud800y", b"/xy"),  # a surrogate decodes to nothing
        (b"/completion%2573", b"/completion%73"),  # one pass, not two
        (b"/completion%7", b"/completion%7"),  # not an escape: kept
        (b"/completion%zz", b"/completion%zz"),
        (b"/completion%u00", b"/completion%u00"),
        (b"/v1/chat/completions%3Fx", b"/v1/chat/completions?x"),  # a decoded ? is path
        (b"/%00", b"/\x00"),
    ],
)
def test_normalise_path_is_what_llama_server_routes_by(target: bytes, want: bytes) -> None:
    assert normalise_path(target) == want


@pytest.mark.parametrize(
    ("target", "want"),
    [
        (b"/v1/chat/completions", False),
        (b"/v1/chat/completions?x=%41", False),  # the query is not routed by
        (b"/v1/chat/completion%73", True),
        (b"/v1/chat/completions#x", True),
        (b"/v1/chat/completions?x#y", True),
        (b"http://h/v1/chat/completions", True),  # absolute form
        (b"*", True),
        (b"", True),
    ],
)
def test_needs_normalising(target: bytes, want: bool) -> None:
    assert needs_normalising(target) is want


@pytest.mark.parametrize(
    ("method", "target", "want"),
    [
        (b"POST", b"/v1/chat/completions", RouteKind.GENERATES),
        (b"POST", b"/v1/chat/completions?stream=1", RouteKind.GENERATES),
        (b"POST", b"/v1/responses", RouteKind.GENERATES),
        (b"POST", b"/v1/messages", RouteKind.DROPS_PRIORITY),
        (b"POST", b"/infill", RouteKind.GENERATES),
        (b"POST", b"/audio/transcriptions", RouteKind.GENERATES),
        (b"POST", b"/v1/chat/completion%73", RouteKind.UNNORMALISED),
        (b"POST", b"/tokenize%23", RouteKind.UNNORMALISED),  # any %, even off a generating route
        (b"POST", b"/completion#x", RouteKind.UNNORMALISED),
        (b"POST", b"/v1/embeddings", RouteKind.OTHER),
        (b"POST", b"/v1/messages/count_tokens", RouteKind.OTHER),
        (b"POST", b"/slots/0?action=save", RouteKind.OTHER),
        (b"POST", b"/slots/", RouteKind.UNKNOWN),  # a parameter segment is never empty
        (b"POST", b"/slots/0/x", RouteKind.UNKNOWN),
        (b"POST", b"/predict", RouteKind.UNKNOWN),  # Vertex AI prediction: any route inside
        (b"POST", b"/v1/chat/completions/", RouteKind.UNKNOWN),
        (b"POST", b"/V1/chat/completions", RouteKind.UNKNOWN),
        (b"GET", b"/v1/chat/completions", RouteKind.OTHER),  # llama-server: GET is not routed there
        (b"PUT", b"/completion%73", RouteKind.OTHER),
        (b"HEAD", b"/completion", RouteKind.OTHER),
    ],
)
def test_classify(method: bytes, target: bytes, want: RouteKind) -> None:
    assert classify(method, target) is want


def test_the_tables_do_not_overlap() -> None:
    assert not GENERATING_ROUTES & OTHER_POST_ROUTES
    assert PRIORITY_DROPPED <= GENERATING_ROUTES
    assert all(r.startswith(b"/") for r in GENERATING_ROUTES | OTHER_POST_ROUTES)

"""The exchange's one state and its writer (sidecar.proxy.downstream.Downstream): every unit,
every state, the bytes a unit writes, and the units a state refuses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import h11
import pytest

from sidecar.core.notices import NoticeKind
from sidecar.core.stream import NoticeSeen, Phase, StreamMonitor
from sidecar.proxy.downstream import Downstream, State, StateError
from sidecar.proxy.h11stream import H11Stream
from sidecar.proxy.transport import TransportStream

pytestmark = pytest.mark.anyio

SSE = [(b"Content-Type", b"text/event-stream")]
HEAD = b"HTTP/1.1 200 \r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Recorder(asyncio.Transport):
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def writer(notices: list[NoticeSeen] | None = None) -> tuple[Downstream, Recorder]:
    """A Downstream whose client sent ``GET /`` (the h11 side is ready for a response)."""
    transport = Recorder()
    stream = TransportStream()
    stream.connection_made(transport)
    client = H11Stream(stream, h11.SERVER)
    client.conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert type(client.conn.next_event()) is h11.Request
    assert type(client.conn.next_event()) is h11.EndOfMessage
    seen = [] if notices is None else notices
    return Downstream(client, StreamMonitor(0.0, 1.0, 10.0), Clock(), seen.append), transport


def response() -> h11.Response:
    return h11.Response(status_code=200, headers=SSE)


# Every move and unit, by name; the sync ones as calls on a Downstream.
UNITS: dict[str, Callable[[Downstream], Any]] = {
    "forwarded": lambda d: d.forwarded(),
    "answered": lambda d: d.answered(),
    "head": lambda d: d.head(response()),
    "early_head": lambda d: d.early_head(response()),
    "piece": lambda d: d.piece(b"data: 1\n\n", None),
    "keepalive": lambda d: d.keepalive(b": keepalive\n\n"),
    "end": lambda d: d.end(),
    "error_event": lambda d: d.error_event({"error": {"code": 502}}),
}
# The units each state allows, and the state each leads to; the rest raise StateError.
MOVES: dict[State, dict[str, State]] = {
    State.REQUEST: {"forwarded": State.QUEUED},
    State.QUEUED: {"early_head": State.EARLY, "answered": State.ANSWERED},
    State.EARLY: {"answered": State.RESPONSE, "keepalive": State.EARLY, "error_event": State.DONE},
    State.ANSWERED: {"head": State.RESPONSE},
    State.RESPONSE: {
        "piece": State.RESPONSE, "keepalive": State.RESPONSE, "end": State.DONE,
        "error_event": State.DONE,
    },
    State.DONE: {},
}  # fmt: skip
# A way to each state.
PATHS = {
    State.REQUEST: [],
    State.QUEUED: ["forwarded"],
    State.EARLY: ["forwarded", "early_head"],
    State.ANSWERED: ["forwarded", "answered"],
    State.RESPONSE: ["forwarded", "answered", "head"],
    State.DONE: ["forwarded", "answered", "head", "end"],
}


def reach(state: State) -> tuple[Downstream, Recorder]:
    d, transport = writer()
    for name in PATHS[state]:
        UNITS[name](d)
    assert d.state is state
    return d, transport


@pytest.mark.parametrize(
    ("state", "unit"),
    [(s, u) for s in State for u in UNITS if u not in MOVES[s]],
    ids=lambda v: v.value if isinstance(v, State) else v,
)
async def test_a_unit_the_state_does_not_allow_raises_and_writes_nothing(
    state: State, unit: str
) -> None:
    d, transport = reach(state)
    before = bytes(transport.written)
    with pytest.raises(StateError, match=state.value):
        UNITS[unit](d)
    assert d.state is state
    assert transport.written == before


@pytest.mark.parametrize(
    ("state", "unit"),
    [(s, u) for s in State for u in MOVES[s]],
    ids=lambda v: v.value if isinstance(v, State) else v,
)
async def test_a_unit_the_state_allows_moves_it(state: State, unit: str) -> None:
    d, transport = reach(state)
    before = len(transport.written)
    UNITS[unit](d)
    assert d.state is MOVES[state][unit]
    wrote = unit not in ("forwarded", "answered")
    assert (len(transport.written) > before) is wrote


async def test_the_relayed_path_writes_a_head_pieces_and_the_end() -> None:
    notices: list[NoticeSeen] = []
    d, transport = writer(notices)
    assert d.phase is Phase.REQUEST
    d.forwarded()
    assert d.phase is Phase.QUEUED
    assert not d.head_sent
    d.answered()
    assert d.state is State.ANSWERED
    d.monitor.answered(1.0, event_stream=True)
    d.head(response())
    assert d.state is State.RESPONSE
    assert d.head_sent
    assert d.open
    assert d.phase is Phase.PROMPT
    assert d.piece(b"data: 1\n\n", None) is False  # not backed up
    assert d.phase is Phase.STREAMING
    assert d.piece(b": preempted\n\n", None) is False
    assert d.phase is Phase.PARKED
    assert [n.kind for n in notices] == [NoticeKind.PREEMPTED]
    assert d.monitor.bytes_out == 9 + 13
    d.keepalive(b": keepalive\n\n")
    d.end()
    assert d.state is State.DONE
    assert not d.open
    assert d.phase is Phase.PARKED
    assert bytes(transport.written) == (
        HEAD
        + b"9\r\ndata: 1\n\n\r\n"
        + b"d\r\n: preempted\n\n\r\n"
        + b"d\r\n: keepalive\n\n\r\n"
        + b"0\r\n\r\n"
    )


async def test_a_piece_in_upstreams_chunks_is_written_as_it_came() -> None:
    d, transport = reach(State.RESPONSE)
    start = len(transport.written)
    d.piece(b"ab", b"1\r\na\r\n1\r\nb\r\n")
    assert bytes(transport.written[start:]) == b"1\r\na\r\n1\r\nb\r\n"


async def test_early_open_then_upstreams_failure_as_an_event() -> None:
    d, transport = reach(State.EARLY)
    assert d.head_sent
    assert d.open
    assert d.phase is Phase.QUEUED  # upstream has not answered
    d.keepalive(b": keepalive\n\n")
    d.answered()
    assert d.state is State.RESPONSE  # our head stands for upstream's
    d.error_event({"error": {"code": 400}})
    assert d.state is State.DONE
    event = b'data: {"error": {"code": 400}}\n\n'
    assert bytes(transport.written) == (
        HEAD + b"d\r\n: keepalive\n\n\r\n" + b"%x\r\n%b\r\n" % (len(event), event) + b"0\r\n\r\n"
    )


@pytest.mark.parametrize("state", [State.REQUEST, State.QUEUED, State.ANSWERED])
async def test_an_error_is_answered_while_no_head_is_out(state: State) -> None:
    d, transport = reach(state)
    assert await d.answer_error(502, "upstream refused")
    assert d.state is State.DONE
    assert transport.written.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
    assert b"\r\nConnection: close\r\n" in transport.written
    assert transport.written.endswith(b'"type": "unavailable_error"}}')


@pytest.mark.parametrize("state", [State.EARLY, State.RESPONSE, State.DONE])
async def test_no_error_answer_once_a_head_is_out(state: State) -> None:
    d, transport = reach(state)
    before = bytes(transport.written)
    assert not await d.answer_error(502, "too late")
    assert d.state is state
    assert transport.written == before

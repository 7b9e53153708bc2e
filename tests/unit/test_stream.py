"""StreamMonitor: phases, park bookkeeping, keepalive decisions, statistics (no I/O)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core.keepalive import Reason
from sidecar.core.notices import NoticeKind, ParkEnded, ParkStarted
from sidecar.core.stream import NoticeSeen, Phase, StreamMonitor

T0 = 100.0


def sse_monitor(park: float = 1.0, idle: float = 10.0) -> StreamMonitor:
    m = StreamMonitor(T0, park, idle)
    assert m.answered(T0, event_stream=True)
    return m


def feed_all(m: StreamMonitor, pieces: list[tuple[float, bytes]]) -> list[NoticeSeen]:
    seen: list[NoticeSeen] = []
    for now, data in pieces:
        seen += m.feed(data, now)
    return seen


# (pieces at times, phase after, parks, parked seconds at finish(T0 + 10), kinds seen)
CASES = [
    ([(101.0, b"data: 1\n\n")], Phase.STREAMING, 0, 0.0, []),
    ([(101.0, b": preempted\n\n")], Phase.PARKED, 1, 9.0, [NoticeKind.PREEMPTED]),
    (
        [(101.0, b": preempted\n\n"), (103.0, b": resumed\n\ndata: x\n\n")],
        Phase.STREAMING, 1, 2.0, [NoticeKind.PREEMPTED, NoticeKind.RESUMED],
    ),
    (
        [(101.0, b": preempted 0\n\n: preempted 1\n\n"), (102.0, b": recomputed 0\n\n")],
        Phase.PARKED, 2, 1.0 + 9.0, [NoticeKind.PREEMPTED] * 2 + [NoticeKind.RECOMPUTED],
    ),
    (
        [(101.0, b": preempted\n\n: preempted\n\n")],  # a repeated notice is one park
        Phase.PARKED, 1, 9.0, [NoticeKind.PREEMPTED] * 2,
    ),
    (
        [(101.0, b":\n\n: preempt-keepalive\n\n: hello\n\n")],
        Phase.STREAMING, 0, 0.0,
        [NoticeKind.PING, NoticeKind.PREEMPT_KEEPALIVE, NoticeKind.OTHER],
    ),
    ([(101.0, b": resumed\n\n")], Phase.STREAMING, 0, 0.0, [NoticeKind.RESUMED]),
]  # fmt: skip


@pytest.mark.parametrize(("pieces", "phase", "parks", "parked_s", "kinds"), CASES)
def test_table(
    pieces: list[tuple[float, bytes]],
    phase: Phase,
    parks: int,
    parked_s: float,
    kinds: list[NoticeKind],
) -> None:
    m = sse_monitor()
    seen = feed_all(m, pieces)
    assert [s.kind for s in seen] == kinds
    assert m.phase is phase
    stats = m.finish(T0 + 10)
    assert stats.parks == parks
    assert stats.parked_seconds == pytest.approx(parked_s)
    assert stats.bytes_out == sum(len(d) for _, d in pieces)
    assert stats.ttfb == pytest.approx(1.0)
    assert stats.parked_at_end is (phase is Phase.PARKED)


def test_notices_report_park_changes_and_flips() -> None:
    m = sse_monitor()
    a, b = m.feed(b": preempted 0\n\n: preempted 1\n\n", 101.0)
    assert a == NoticeSeen(NoticeKind.PREEMPTED, ParkStarted(0), parked=True)
    assert b == NoticeSeen(NoticeKind.PREEMPTED, ParkStarted(1))  # already parked
    (c,) = m.feed(b": resumed 0\n\n", 102.0)
    assert isinstance(c.change, ParkEnded)
    assert c.parked is None
    (d,) = m.feed(b": recomputed 1\n\n", 104.0)
    assert d.change == ParkEnded(1, 3.0, True, 101.0)
    assert d.parked is False


def test_phases_of_a_response() -> None:
    # before upstream answers, the phase is the exchange's (tests/unit/test_exchange_state.py)
    m = StreamMonitor(T0, 1.0, 10.0)
    assert not m.answered(101.0, event_stream=False)
    assert m.phase is Phase.PROMPT
    assert m.feed(b'{"content": ": preempted"}\n\n', 102.0) == ()  # not an event stream
    assert m.phase is Phase.STREAMING
    stats = m.finish(103.0)
    assert not stats.event_stream
    assert stats.longest_silence is None
    assert stats.duration == 3.0
    assert stats.parks == 0


def test_unended_parks_close_at_finish() -> None:
    m = sse_monitor()
    m.feed(b": preempted\n\n", 101.0)
    stats = m.finish(105.0)
    assert stats.unended_parks == (ParkEnded(None, 4.0, False, 101.0),)
    assert stats.parked_seconds == 4.0


def test_keepalive_reasons_and_counting() -> None:
    m = sse_monitor(park=1.0, idle=10.0)
    assert m.keepalive_due(105.0) is None
    ka = m.keepalive_due(110.0)
    assert ka is not None
    assert ka.reason is Reason.IDLE
    assert m.keepalive_due(110.0) is None  # counted as written
    m.feed(b": preempted\n\n", 111.0)
    ka = m.keepalive_due(112.0)
    assert ka is not None
    assert ka.reason is Reason.PARK
    assert m.finish(112.5).keepalives == 2


def test_keepalive_only_at_an_event_boundary() -> None:
    m = sse_monitor(park=1.0, idle=10.0)
    m.feed(b"data: half an ev", 101.0)
    assert m.keepalive_due(120.0) is None
    # Due but inside the event: the rest of it is a write, so ask again one interval on.
    assert m.next_check(120.0) == 10.0
    m.feed(b"ent\n\n", 125.0)
    assert m.keepalive_due(130.0) is None
    assert m.keepalive_due(135.0) is not None


def test_next_check_never_sleeps_past_a_park_deadline() -> None:
    m = sse_monitor(park=1.0, idle=10.0)
    assert m.next_check(T0) == 1.0  # idle deadline is 10 s away, a park may start
    m.feed(b": preempted\n\n", 100.5)
    assert m.next_check(101.0) == pytest.approx(0.5)


def test_early_open_keepalives_until_upstream_answers() -> None:
    m = StreamMonitor(T0, 1.0, 10.0)
    assert m.opened_early(101.0)
    ka = m.keepalive_due(111.0, early_open=True)
    assert ka is not None
    assert ka.reason is Reason.EARLY_OPEN
    assert not m.answered(112.0, event_stream=True)  # the stream started already
    ka = m.keepalive_due(121.0)
    assert ka is not None
    assert ka.reason is Reason.IDLE
    assert m.event_stream


def test_longest_silence_counts_writes_and_keepalives() -> None:
    m = sse_monitor(park=1.0, idle=10.0)
    m.feed(b"data: 1\n\n", 103.0)
    m.feed(b"data: 2\n\n", 104.0)
    assert m.keepalive_due(114.0) is not None
    stats = m.finish(116.0)
    assert stats.longest_silence == pytest.approx(10.0)


STREAM = (
    b"data: a\n\n: preempted 0\n\n: preempt-keepalive\n\ndata: b\r\n\r\n"
    b": resumed 0\r\n\r\n:\n\ndata: c\rdata: d\r\r: preempted\n\n: recomputed\n\n"
)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_split_gives_the_same_notices_and_stats(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    whole = sse_monitor()
    expected = [s.kind for s in whole.feed(STREAM, 101.0)]
    split = sse_monitor()
    got = [s.kind for piece in pieces for s in split.feed(piece, 101.0)]
    assert got == expected
    assert split.phase is whole.phase
    assert split.finish(102.0) == whole.finish(102.0)


def test_byte_by_byte() -> None:
    whole, split = sse_monitor(), sse_monitor()
    expected = [s.kind for s in whole.feed(STREAM, 101.0)]
    got = [s.kind for i in range(len(STREAM)) for s in split.feed(STREAM[i : i + 1], 101.0)]
    assert got == expected
    assert expected.count(NoticeKind.PREEMPTED) == 2
    assert split.finish(102.0) == whole.finish(102.0)

"""Notice classifier and the parked-prompt set."""

from __future__ import annotations

import pytest

from sidecar.core.notices import Notice, NoticeKind, ParkEnded, ParkStarted, ParkTracker, classify

K = NoticeKind


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b" preempted", Notice(K.PREEMPTED)),
        (b" resumed", Notice(K.RESUMED)),
        (b" recomputed", Notice(K.RECOMPUTED)),
        (b" preempt-keepalive", Notice(K.PREEMPT_KEEPALIVE)),
        (b" preempted 1", Notice(K.PREEMPTED, 1)),
        (b" resumed 0", Notice(K.RESUMED, 0)),
        (b" recomputed 12", Notice(K.RECOMPUTED, 12)),
        (b" preempt-keepalive 3", Notice(K.PREEMPT_KEEPALIVE, 3)),
        (b"preempted", Notice(K.PREEMPTED)),
        (b"", Notice(K.PING)),
        (b" ", Notice(K.PING)),
        (b" keepalive", Notice(K.OTHER)),
        (b" preempted x", Notice(K.OTHER)),
        (b" preempted 1 2", Notice(K.OTHER)),
        (b" preempted -1", Notice(K.OTHER)),
        (b" Preempted", Notice(K.OTHER)),
        (b" hello world", Notice(K.OTHER)),
    ],
)
def test_classify(text: bytes, expected: Notice) -> None:
    assert classify(text) == expected


def test_tracker_single_prompt() -> None:
    t = ParkTracker()
    assert not t.parked
    assert t.apply(Notice(K.PREEMPTED), 1.0) == ParkStarted(None)
    assert t.parked
    assert t.apply(Notice(K.PREEMPTED), 1.5) is None
    assert t.apply(Notice(K.PREEMPT_KEEPALIVE), 2.0) is None
    assert t.apply(Notice(K.RESUMED), 4.0) == ParkEnded(None, 3.0, False, 1.0)
    assert not t.parked
    assert t.apply(Notice(K.RESUMED), 5.0) is None


def test_tracker_indexed_prompts() -> None:
    t = ParkTracker()
    t.apply(Notice(K.PREEMPTED, 0), 0.0)
    t.apply(Notice(K.PREEMPTED, 1), 1.0)
    assert t.parked_count == 2
    assert t.apply(Notice(K.RECOMPUTED, 0), 2.0) == ParkEnded(0, 2.0, True, 0.0)
    assert t.parked
    assert t.close(5.0) == [ParkEnded(1, 4.0, False, 1.0)]
    assert not t.parked

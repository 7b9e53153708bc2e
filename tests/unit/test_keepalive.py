"""Keepalive policy with a fake clock."""

from __future__ import annotations

import pytest

from sidecar.core.keepalive import KEEPALIVE_IDLE, KEEPALIVE_PARK, KeepalivePolicy, Reason


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_idle_interval() -> None:
    clock = FakeClock()
    p = KeepalivePolicy(1.0, 10.0, clock())
    clock.t += 9.99
    assert p.due(clock(), parked=False, at_boundary=True) is None
    clock.t += 0.01
    assert p.due(clock(), parked=False, at_boundary=True) is KEEPALIVE_IDLE
    assert KEEPALIVE_IDLE.payload == b": keepalive\n\n"


def test_park_interval_and_payload() -> None:
    clock = FakeClock()
    p = KeepalivePolicy(1.0, 10.0, clock())
    assert p.deadline(parked=True) == 101.0
    clock.t += 1.0
    ka = p.due(clock(), parked=True, at_boundary=True)
    assert ka is KEEPALIVE_PARK
    assert ka.payload == b": preempt-keepalive\n\n"
    assert ka.reason is Reason.PARK


def test_writes_reset_the_deadline() -> None:
    clock = FakeClock()
    p = KeepalivePolicy(1.0, 10.0, clock())
    for _ in range(5):
        clock.t += 0.9
        p.wrote(clock())
        assert p.due(clock(), parked=True, at_boundary=True) is None
    clock.t += 1.0
    assert p.due(clock(), parked=True, at_boundary=True) is KEEPALIVE_PARK


def test_never_inside_an_event() -> None:
    clock = FakeClock()
    p = KeepalivePolicy(1.0, 10.0, clock())
    clock.t += 50
    assert p.due(clock(), parked=True, at_boundary=False) is None
    assert p.due(clock(), parked=False, at_boundary=False) is None
    assert p.due(clock(), parked=False, at_boundary=True) is KEEPALIVE_IDLE


def test_early_open_reason() -> None:
    clock = FakeClock()
    p = KeepalivePolicy(1.0, 2.0, clock())
    clock.t += 2
    ka = p.due(clock(), parked=False, at_boundary=True, early_open=True)
    assert ka is not None
    assert ka.reason is Reason.EARLY_OPEN


def test_longest_silence() -> None:
    clock = FakeClock()
    p = KeepalivePolicy(1.0, 10.0, clock())
    clock.t += 0.5
    p.wrote(clock())
    clock.t += 2.0
    p.wrote(clock())
    clock.t += 0.1
    assert p.longest_silence == pytest.approx(2.0)
    clock.t += 5
    assert p.silence(clock()) == pytest.approx(5.1)


def test_lead_makes_it_due_early() -> None:
    clock = FakeClock()
    p = KeepalivePolicy(1.0, 10.0, clock(), lead=0.1)
    assert p.deadline(parked=True) == pytest.approx(100.9)
    assert p.deadline(parked=False) == pytest.approx(109.0)
    clock.t += 0.9
    assert p.due(clock(), parked=True, at_boundary=True) is KEEPALIVE_PARK


def test_rejects_bad_intervals() -> None:
    with pytest.raises(ValueError, match="intervals must be positive"):
        KeepalivePolicy(0, 10, 0.0)
    with pytest.raises(ValueError, match="lead must be a fraction"):
        KeepalivePolicy(1, 10, 0.0, lead=1.0)

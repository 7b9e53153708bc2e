"""The readiness policy (sidecar/core/readiness.py), driven by tables: no sockets, no clock."""

from __future__ import annotations

import pytest

from sidecar.core.readiness import KV_TOTAL, KV_USED, PARKED, Readiness, Verdict, parse_samples


def text(**samples: float) -> str:
    names = {"parked": PARKED, "used": KV_USED, "total": KV_TOTAL}
    lines = ["# HELP llamacpp:requests_processing whatever", "# TYPE x gauge"]
    lines += [f"{names.get(k, 'llamacpp:' + k)} {v}" for k, v in samples.items()]
    return "\n".join(lines) + "\n"


def test_parse_samples_skips_comments_labels_and_junk() -> None:
    got = parse_samples(
        '# HELP a b\n# TYPE a gauge\na 1\nb{x="1"} 2.5\nb{x="2"} 9\nc notanumber\n\n d 3 1700\n'
    )
    assert got == {"a": 1.0, "b": 2.5, "d": 3.0}


@pytest.mark.parametrize(
    ("reading", "min_free", "ready", "reason"),
    [
        (text(parked=0), 0.0, True, "no parked requests"),
        (text(parked=2), 0.0, False, "2 request(s) parked"),
        # the KV share applies only when asked for and only where the server exports it
        (text(parked=0, used=900, total=1000), 0.0, True, "no parked requests"),
        (text(parked=0, used=900, total=1000), 0.2, False, "free KV 10% < 20%"),
        (text(parked=0, used=700, total=1000), 0.2, True, "free KV 30%"),
        (text(parked=0), 0.2, True, "no parked requests"),
        # parked beats a roomy pool: a parked request is waiting for exactly that room
        (text(parked=1, used=0, total=1000), 0.2, False, "1 request(s) parked"),
        # a stock llama-server has no parking gauge: say so rather than guess
        (text(processing=1), 0.0, False, "no llamacpp:requests_preempted"),
        # a lying or broken upstream: a parked count that is not a count is not "none parked"
        ("llamacpp:requests_preempted NaN\n", 0.0, False, "not a count"),
        ("llamacpp:requests_preempted -1\n", 0.0, False, "not a count"),
        ("llamacpp:requests_preempted +Inf\n", 0.0, False, "not a count"),
    ],
)
def test_verdict_from_one_reading(reading: str, min_free: float, ready: bool, reason: str) -> None:
    r = Readiness(1.0, min_free)
    r.observe(reading, now=10.0)
    verdict = r.verdict(10.5)
    assert verdict.ready is ready
    assert reason in verdict.reason
    assert verdict.body().startswith(b"ready: " if ready else b"not ready: ")


def test_fails_safe_before_the_first_reading_after_a_failure_and_when_stale() -> None:
    r = Readiness(0.5)
    assert not r.verdict(0.0).ready
    assert "no reading" in r.verdict(0.0).reason
    r.observe(text(parked=0), now=1.0)
    assert r.verdict(1.0).ready
    assert r.verdict(2.5).ready  # three intervals: still fresh
    stale = r.verdict(2.6)
    assert not stale.ready
    assert "old" in stale.reason
    r.failed("ConnectError", now=3.0)
    assert not r.verdict(3.0).ready
    assert "ConnectError" in r.verdict(3.0).reason
    r.observe(text(parked=0), now=3.5)
    assert r.verdict(3.5).ready


def test_flips_count_changes_of_verdict() -> None:
    r = Readiness(1.0)
    for now, parked in enumerate([0, 0, 1, 1, 0, 3, 0]):
        r.observe(text(parked=parked), now=float(now))
    assert r.flips == 4


def test_off_is_never_ready() -> None:
    r = Readiness(0.0)
    assert r.verdict(5.0) == Verdict(False, "readiness is off (--ready-poll 0)")


@pytest.mark.parametrize(
    ("poll", "share", "message"),
    [(-1.0, 0.0, "poll_interval must not be negative"),
     (1.0, 1.0, "min_free_kv is a share of the pool"),
     (1.0, -0.1, "min_free_kv is a share of the pool")],
)  # fmt: skip
def test_rejects_settings_it_cannot_take(poll: float, share: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Readiness(poll, share)

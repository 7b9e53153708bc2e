"""Operator-set request priority (sidecar/priority.py): rules and the body rewrite, by table."""

from __future__ import annotations

import json

import pytest

from sidecar.priority import PriorityRules, parse_priority_keys, with_priority


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (None, {}),
        ("", {}),
        ("k1=10", {"k1": 10}),
        (" k1=10 , k2=-5 ,", {"k1": 10, "k2": -5}),
        ("a=b=3", {"a=b": 3}),  # the last "=" splits: keys may contain "="
    ],
)
def test_parse_priority_keys(spec: str | None, want: dict[str, int]) -> None:
    assert parse_priority_keys(spec) == want


@pytest.mark.parametrize("spec", ["k1", "=3", "k1=high", "k1=1.5", "k1=2000000"])
def test_parse_priority_keys_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match="priority"):
        parse_priority_keys(spec)


RULES = PriorityRules(by_key={"gold": 10, "batch": -5}, header=b"x-priority", default=1)


@pytest.mark.parametrize(
    ("rules", "key", "header", "want"),
    [
        (RULES, "gold", b"-3", 10),  # the key wins over the header
        (RULES, "batch", None, -5),
        (RULES, "unknown", b"7", 7),  # a trusted header
        (RULES, None, b" 7 ", 7),
        (RULES, None, b"high", 1),  # malformed: the default
        (RULES, None, b"99999999", 1),  # out of range: the default
        (RULES, None, b"\xff", 1),
        (RULES, None, None, 1),
        (PriorityRules(by_key={"gold": 10}), None, b"999", 0),  # untrusted header: ignored
    ],
)
def test_priority_for(
    rules: PriorityRules, key: str | None, header: bytes | None, want: int
) -> None:
    assert rules.priority_for(key, header) == want


def test_active_only_with_a_rule() -> None:
    assert not PriorityRules().active
    assert PriorityRules(default=-1).active
    assert PriorityRules(header=b"x-priority").active
    assert PriorityRules(by_key={"k": 0}).active


@pytest.mark.parametrize(
    ("body", "priority", "want"),
    [
        (b'{"prompt":"hi","priority":99}', 2, {"prompt": "hi", "priority": 2}),  # overwritten
        (b'{"messages":[{"role":"user","content":"\xc3\xa9"}]}', -1,
         {"messages": [{"role": "user", "content": "\u00e9"}], "priority": -1}),
    ],
)  # fmt: skip
def test_with_priority_sets_the_field(body: bytes, priority: int, want: dict[str, object]) -> None:
    out = with_priority(body, priority)
    assert out is not None
    assert json.loads(out) == want


@pytest.mark.parametrize(
    "body", [b"", b"not json", b"[1,2]", b'"str"', b"\xff\xfe", b'{"a":', b"[" * 100000]
)
def test_with_priority_leaves_what_it_cannot_parse(body: bytes) -> None:
    assert with_priority(body, 3) is None

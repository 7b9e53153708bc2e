"""Operator-set request priority (sidecar/core/priority.py): rules and the body splice, by table."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core.priority import (
    LIMIT,
    NotAnObject,
    PriorityRules,
    parse_priority_keys,
    with_priority,
)


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
        (b'{"prompt":"hi"}', 2, b'{"prompt":"hi","priority":2}'),
        (b'{"prompt":"hi","priority":99}', 2, b'{"prompt":"hi","priority":99,"priority":2}'),
        (b"{}", -1, b'{"priority":-1}'),
        (b" {\r\n\t} \n", 0, b' {\r\n\t"priority":0} \n'),  # whitespace kept where it was
        (b'{"a":"}"}  ', 5, b'{"a":"}","priority":5}  '),
        (b'\xef\xbb\xbf{"a":1}', 5, b'\xef\xbb\xbf{"a":1,"priority":5}'),  # a BOM is skipped
        (b'{"a":[' * 3000 + b"]}" * 3000, 1, None),  # any depth: nothing is parsed
    ],
)  # fmt: skip
def test_with_priority_splices_the_member_before_the_last_brace(
    body: bytes, priority: int, want: bytes | None
) -> None:
    out = with_priority(body, priority)
    if want is None:
        assert out == body[:-1] + b',"priority":1}'
    else:
        assert out == want


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "empty"),
        (b" \r\n", "empty"),
        (b"not json", "not a JSON object"),
        (b"[1,2]", "not a JSON object"),
        (b'"str"', "not a JSON object"),
        (b"{", "not a JSON object"),
        (b"}", "not a JSON object"),
        (b'{"a":1', "not a JSON object"),
        (b'{"a":1}]', "not a JSON object"),
        (b"\xef\xbb{}", "not a JSON object"),  # half a BOM: llama-server refuses it too
        (b'{"a":1}\x00', "NUL"),  # llama-server's parser stops at a NUL byte
        (b'{"a":1}\x00{"priority":1000000}', "NUL"),
        (b'{"a":"\x00"}', "NUL"),
    ],
)
def test_with_priority_refuses_what_is_not_one_json_object(body: bytes, why: str) -> None:
    with pytest.raises(NotAnObject, match=why):
        with_priority(body, 3)


OBJECTS = st.dictionaries(
    st.text(max_size=8),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                      max_size=4),
        max_leaves=12,
    ),
    max_size=6,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(OBJECTS, st.integers(-LIMIT, LIMIT), st.data())
def test_any_split_gives_the_same_body_and_the_priority_wins(
    obj: dict[str, object], priority: int, data: st.DataObject
) -> None:
    text = json.dumps(obj, ensure_ascii=data.draw(st.booleans())).encode()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    out = with_priority(pieces, priority)
    assert out == with_priority(text, priority)
    # the last of duplicate keys wins, in Python's parser as in llama-server's
    assert json.loads(out) == {**obj, "priority": priority}


@settings(max_examples=200, deadline=None)
@given(OBJECTS, st.data())
def test_a_cut_body_never_parses_with_another_priority(
    obj: dict[str, object], data: st.DataObject
) -> None:
    """The splice's safety argument, tried: whatever a client puts before the last ``}``,
    the result either does not parse (llama-server refuses it) or is an object whose
    priority is the operator's."""
    text = json.dumps({"priority": LIMIT, **obj, "x": obj}).encode()
    cut = data.draw(st.integers(1, len(text)))
    body = text[:cut] + b"}"
    try:
        out = with_priority(body, -7)
    except NotAnObject:
        return
    try:
        parsed = json.loads(out)
    except ValueError:
        return
    assert isinstance(parsed, dict)
    assert parsed["priority"] == -7, out

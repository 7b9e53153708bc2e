"""Request priority set by the operator: which API key or header gets which ``priority``.

llama-server (patched, issue 14) reads an integer ``priority`` from a completion body: when
the KV pool is full it parks the lowest priority first and restores the highest first.
Clients must not choose their own priority, so once an operator configures any rule the
sidecar sets the field on *every* JSON completion body it forwards, overwriting whatever
the client sent: the priority of the request's API key (``--priority-keys
'KEY=10,OTHER=-5'``), else the value of the header named by ``--priority-header``
(``X-Priority``, say; name only a header that a trusted hop sets or strips, such as nginx
setting it per route), else ``--priority-default`` (0).

A body the sidecar cannot parse as a JSON object is forwarded unchanged (llama-server gives
its own error, or serves it at its default priority) and counted
(``llama_sidecar_priority_requests_total{outcome="unparsed"}``): the sidecar never rewrites
what it does not understand.  Everything here is pure: no I/O, tested with tables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "PRIORITY_ROUTES", "PriorityRules", "parse_priority_keys", "priority_value", "with_priority",
]  # fmt: skip

# llama-server's completion routes: the bodies that carry a priority
PRIORITY_ROUTES = frozenset(
    {b"/completion", b"/completions", b"/v1/completions", b"/chat/completions",
     b"/v1/chat/completions", b"/infill"}
)  # fmt: skip
LIMIT = 1_000_000  # llama-server's bounds for the field


def parse_priority_keys(spec: str | None) -> dict[str, int]:
    """``"KEY=10,OTHER=-5"`` -> ``{"KEY": 10, "OTHER": -5}``; a clear ValueError otherwise."""
    out: dict[str, int] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.rpartition("=")
        if not sep or not key:
            raise ValueError(f"priority keys: expected KEY=PRIORITY, got {item!r}")
        out[key] = priority_value(value, f"priority of key {key[:4]}...")
    return out


def priority_value(value: str | int, what: str) -> int:
    """``value`` as a priority llama-server takes, or a ValueError naming ``what``."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: not an integer: {value!r}") from None
    if not -LIMIT <= number <= LIMIT:
        raise ValueError(f"{what}: {number} is outside -{LIMIT}..{LIMIT}")
    return number


@dataclass(frozen=True, slots=True)
class PriorityRules:
    by_key: Mapping[str, int] = field(default_factory=dict)
    header: bytes | None = None  # the trusted header's name, lower case
    default: int = 0

    @property
    def active(self) -> bool:
        """Whether the sidecar sets priorities at all (any rule configured)."""
        return bool(self.by_key) or self.header is not None or self.default != 0

    def priority_for(self, api_key: str | None, header: bytes | None) -> int:
        """The request's priority: its key's, else the trusted header's value, else the default.

        ``header`` is the request's value of :attr:`header` (None when absent or when no
        header is trusted); a malformed value is ignored and the default applies.
        """
        if api_key is not None and api_key in self.by_key:
            return self.by_key[api_key]
        if self.header is not None and header is not None:
            try:
                return priority_value(header.decode("ascii").strip(), "X-Priority")
            except (UnicodeDecodeError, ValueError):
                pass
        return self.default


def with_priority(body: bytes, priority: int) -> bytes | None:
    """``body`` (a JSON object) with ``"priority"`` set, or None when it is not a JSON object."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    data["priority"] = priority
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()

"""The suite's one SSE recorder: every read and every line of a response, with arrival times.

SSE client libraries hide comment lines, and comment lines are what the tests are about
(``: preempted``, ``: resumed``, ``: preempt-keepalive``, the sidecar's ``: keepalive``,
the bare ``:`` ping). So the body is read raw, each read is kept with the time it
arrived, and lines are split on bytes with :func:`sidecar.ops.probe.split_lines` (``\\n``,
``\\r\\n`` or ``\\r``; never ``str.splitlines``, which also breaks on U+2028 or U+0085 that
generated text may hold). A line's time is the arrival of the read that completed it.

* :func:`stream_sse`: blocking (httpx), for threads and synchronous tests;
* :func:`astream_sse`: the same from an event loop;
* :func:`iter_lines`: the line splitter alone, over any iterable of byte chunks.

Times are seconds since the request was sent (``t_start``, ``time.monotonic()``).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from sidecar.ops.probe import split_lines
from tests.support.memnet import http_client

OnRead = Callable[[float, bytes], None]


@dataclass
class StreamLog:
    """One recorded response: status, headers, reads and lines, each with its arrival time."""

    status: int
    lines: list[tuple[float, str]]  # non-empty lines
    t_start: float
    t_headers: float = 0.0
    error: str | None = None  # the transport error that ended the stream early, if any
    headers: dict[str, str] = field(default_factory=dict)
    reads: list[tuple[float, bytes]] = field(default_factory=list)

    @property
    def raw(self) -> bytes:
        """The body as it arrived (de-chunked, nothing else changed)."""
        return b"".join(d for _, d in self.reads)

    @property
    def comments(self) -> list[tuple[float, str]]:
        return [(t, ln) for t, ln in self.lines if ln.startswith(":")]

    @property
    def events(self) -> list[Any]:
        """Decoded `data:` payloads, `[DONE]` excluded."""
        out = []
        for _, ln in self.lines:
            if ln.startswith("data: ") and ln != "data: [DONE]":
                out.append(json.loads(ln[6:]))
        return out

    @property
    def done(self) -> bool:
        return any(ln == "data: [DONE]" for _, ln in self.lines)

    def body(self) -> str:
        return "\n".join(ln for _, ln in self.lines)

    def content(self) -> str:
        """Concatenated generated text of a /completion or chat stream."""
        parts = []
        for ev in self.events:
            if "content" in ev and isinstance(ev["content"], str):
                parts.append(ev["content"])
            for ch in ev.get("choices", []) or []:
                delta = ch.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    parts.append(delta["content"])
                elif isinstance(ch.get("text"), str):
                    parts.append(ch["text"])
        return "".join(parts)

    def tokens(self) -> list[int]:
        out: list[int] = []
        for ev in self.events:
            out.extend(ev.get("tokens", []) or [])
        return out

    def final(self) -> Any:
        """The last data event (the one carrying timings/usage)."""
        ev = self.events
        return ev[-1] if ev else None


class _Lines:
    """Incremental line splitting over timed reads."""

    def __init__(self) -> None:
        self.buf = b""
        self.lines: list[tuple[float, str]] = []

    def feed(self, now: float, data: bytes) -> list[str]:
        got, self.buf = split_lines(self.buf + data)
        text = [ln.decode("utf-8", "replace") for ln in got]
        self.lines.extend((now, ln) for ln in text if ln)
        return text

    def finish(self, now: float) -> list[str]:
        rest, self.buf = self.buf, b""
        if not rest:
            return []
        ln = rest.decode("utf-8", "replace")
        self.lines.append((now, ln))
        return [ln]


def max_gap(times: Iterable[float]) -> float:
    """The longest interval between consecutive times (0 for fewer than two)."""
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def iter_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Lines (empty ones included) of a byte stream, split as SSE splits them."""
    lines = _Lines()
    for chunk in chunks:
        yield from lines.feed(0.0, chunk)
    yield from lines.finish(0.0)


def _request_kwargs(body: Mapping[str, Any] | None) -> dict[str, Any]:
    return {} if body is None else {"json": body}


def stream_sse(
    url: str, body: Mapping[str, Any] | None = None, timeout: float = 300.0,
    headers: Mapping[str, str] | None = None, *, method: str = "POST",
    on_read: OnRead | None = None,
) -> StreamLog:  # fmt: skip
    """Send the request and record the response read by read (blocking).

    ``on_read(t, data)`` is called for each read as it arrives (a watcher in another
    thread can see the stream start).
    """
    t0 = time.monotonic()
    log = StreamLog(0, [], t0)
    lines = _Lines()
    t = httpx.Timeout(timeout, connect=10.0)
    with httpx.stream(method, url, timeout=t, headers=headers, **_request_kwargs(body)) as r:
        log.status, log.headers = r.status_code, dict(r.headers)
        log.t_headers = time.monotonic() - t0
        try:
            for data in r.iter_raw():
                now = time.monotonic() - t0
                log.reads.append((now, data))
                lines.feed(now, data)
                if on_read is not None:
                    on_read(now, data)
        except httpx.HTTPError as e:
            log.error = repr(e)
    lines.finish(time.monotonic() - t0)
    log.lines = lines.lines
    return log


async def astream_sse(
    url: str, body: Mapping[str, Any] | None = None, timeout: float = 30.0,
    headers: Mapping[str, str] | None = None, *, method: str = "POST",
) -> StreamLog:  # fmt: skip
    """:func:`stream_sse` on the caller's event loop."""
    t0 = time.monotonic()
    log = StreamLog(0, [], t0)
    lines = _Lines()
    async with (
        http_client(timeout=timeout) as c,
        c.stream(method, url, headers=headers, **_request_kwargs(body)) as r,
    ):
        log.status, log.headers = r.status_code, dict(r.headers)
        log.t_headers = time.monotonic() - t0
        try:
            async for data in r.aiter_raw():
                now = time.monotonic() - t0
                log.reads.append((now, data))
                lines.feed(now, data)
        except httpx.HTTPError as e:
            log.error = repr(e)
    lines.finish(time.monotonic() - t0)
    log.lines = lines.lines
    return log

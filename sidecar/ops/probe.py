"""`llama-sidecar probe`: concurrent streaming requests, timestamped line by line.

Theory of operation
-------------------
:func:`run_probe` opens N streaming requests at once (optionally staggered) and records
every SSE line with its arrival time, measured from one common start so the streams line
up on a timeline.  SSE client libraries hide comment lines, and the comment lines are the
point here (``: preempted``, ``: resumed``, ``: recomputed``, ``: preempt-keepalive``, the
sidecar's ``: keepalive``, the bare ``:`` ping), so the body is read raw and split on
``\\n``, ``\\r\\n`` or ``\\r`` (WHATWG HTML, "Server-sent events", 9.2.5).

:func:`summarize` is pure: a recorded stream in, its counts out (parks, resumes,
keepalives, longest silence, tokens per second, the park intervals for the plot).
:func:`plot` draws one lane per stream with matplotlib (imported lazily: an extra).
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx

from sidecar.core.notices import NoticeKind, ParkEnded, ParkTracker, classify

__all__ = [
    "ProbeOptions",
    "StreamRecord",
    "StreamSummary",
    "build_body",
    "endpoint_url",
    "has_chat_template",
    "plot",
    "run_probe",
    "split_lines",
    "summarize",
    "totals",
]

DEFAULT_PATH = "/v1/chat/completions"
NATIVE_PATH = "/completion"
INTERRUPTED = "interrupted"
# What llama-server's /props reports as `chat_template` when the model has none and none was
# named (common/chat.cpp, CHATML_TEMPLATE_SRC): its ChatML fallback, byte for byte.
FALLBACK_CHATML = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class ProbeOptions:
    url: str
    streams: int = 2
    prompt: str = "Write a long story about a lighthouse keeper."
    max_tokens: int = 160
    ignore_eos: bool = True
    stagger: float = 0.0
    timeout: float = 600.0
    api_key: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class StreamRecord:
    """One request as the client saw it; times are seconds since the probe started."""

    index: int
    t_start: float = 0.0
    t_headers: float | None = None
    t_end: float = 0.0
    status: int | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)
    error: str | None = None


@dataclass
class StreamSummary:
    index: int
    status: int | None
    outcome: str  # done | truncated | error
    tokens: int
    ttft_s: float | None
    tokens_per_s: float | None
    parks: int
    resumes: int
    recomputes: int
    keepalives: int  # ': preempt-keepalive' and the sidecar's ': keepalive'
    pings: int  # bare ':'
    parked_s: float
    longest_silence_s: float
    duration_s: float
    park_spans: list[tuple[float, float]] = field(default_factory=list)
    keepalive_times: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    error: str | None = None


def endpoint_url(url: str) -> str:
    """A bare base URL means the chat endpoint; any other path is used as given."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    path = parts.path if parts.path not in ("", "/") else DEFAULT_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def has_chat_template(url: str, api_key: str | None = None, timeout: float = 10.0) -> bool | None:
    """Whether the served model has a chat template, from llama-server's ``GET /props``.

    False when /props shows llama-server's ChatML fallback (the model has no template and
    none was named with --chat-template); None when the server does not say (no /props).
    """
    parts = urlsplit(url if "://" in url else "http://" + url)
    props_url = urlunsplit((parts.scheme, parts.netloc, "/props", "", ""))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(props_url, headers=headers, timeout=timeout, trust_env=False)
        template = r.json().get("chat_template") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(template, str):
        return None
    return template != FALLBACK_CHATML


def build_body(url: str, opts: ProbeOptions) -> dict[str, Any]:
    """The request body for the endpoint's dialect (chat, OpenAI completions, native)."""
    path = urlsplit(url).path.rstrip("/")
    body: dict[str, Any]
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": opts.prompt}],
                "max_tokens": opts.max_tokens}  # fmt: skip
    elif path.endswith("/v1/completions"):
        body = {"prompt": opts.prompt, "max_tokens": opts.max_tokens}
    else:  # llama-server's native /completion
        body = {"prompt": opts.prompt, "n_predict": opts.max_tokens}
    body["stream"] = True
    if opts.ignore_eos:
        body["ignore_eos"] = True
    body.update(opts.extra)
    return body


def split_lines(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines of `buf` and the rest; a final ``\\r`` waits (it may start ``\\r\\n``)."""
    lines: list[bytes] = []
    start = i = 0
    n = len(buf)
    while i < n:
        c = buf[i]
        if c in (0x0A, 0x0D):
            if c == 0x0D and i + 1 == n:
                break
            lines.append(buf[start:i])
            i += 2 if c == 0x0D and buf[i + 1] == 0x0A else 1
            start = i
        else:
            i += 1
    return lines, buf[start:]


OnLine = Callable[[int, float, str], None]


async def _one(
    client: httpx.AsyncClient,
    url: str,
    body: Mapping[str, Any],
    rec: StreamRecord,
    t0: float,
    delay: float,
    on_line: OnLine | None,
) -> None:
    if delay > 0:
        await anyio.sleep(delay)
    rec.t_start = time.monotonic() - t0
    try:
        async with client.stream("POST", url, json=dict(body)) as r:
            rec.t_headers = time.monotonic() - t0
            rec.status = r.status_code
            buf = b""
            async for chunk in r.aiter_raw():
                now = time.monotonic() - t0
                got, buf = split_lines(buf + chunk)
                for raw in got:
                    if raw:
                        text = raw.decode("utf-8", "replace")
                        rec.lines.append((now, text))
                        if on_line is not None:
                            on_line(rec.index, now, text)
            if buf:
                rec.lines.append((time.monotonic() - t0, buf.decode("utf-8", "replace")))
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    rec.t_end = time.monotonic() - t0


async def _run(
    opts: ProbeOptions, on_line: OnLine | None, records: list[StreamRecord], handle_sigint: bool
) -> list[StreamRecord]:
    url = endpoint_url(opts.url)
    body = build_body(url, opts)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None
    timeout = httpx.Timeout(opts.timeout, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        timeout=timeout, limits=limits, headers=headers, trust_env=False
    ) as client:
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            if handle_sigint:
                tg.start_soon(_stop_on_sigint, tg.cancel_scope, records, t0)
            async with anyio.create_task_group() as streams:
                for rec in records:
                    streams.start_soon(
                        _one, client, url, body, rec, t0, rec.index * opts.stagger, on_line
                    )
            tg.cancel_scope.cancel()  # all streams ended: stop listening for SIGINT
    return records


async def _stop_on_sigint(scope: anyio.CancelScope, records: list[StreamRecord], t0: float) -> None:
    """Ctrl-C ends the run but keeps what arrived: unfinished streams say "interrupted"."""
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            now = time.monotonic() - t0
            for rec in records:
                if not rec.t_end:
                    rec.t_end = now
                    rec.error = rec.error or INTERRUPTED
            scope.cancel()
            return


def run_probe(
    opts: ProbeOptions, on_line: OnLine | None = None, *, handle_sigint: bool = False
) -> list[StreamRecord]:
    """Run the probe to completion; `on_line(stream, t, text)` sees each line as it arrives.

    With `handle_sigint` (main thread only), Ctrl-C ends the run early and returns what
    was recorded; the streams it cut have ``error == INTERRUPTED``.
    """
    records = [StreamRecord(i) for i in range(opts.streams)]
    return anyio.run(_run, opts, on_line, records, handle_sigint)


def _event_tokens(payload: Any) -> int:
    """Generated pieces in one streamed event (llama-server sends one token per event)."""
    if not isinstance(payload, dict):
        return 0
    if isinstance(payload.get("content"), str) and payload["content"]:
        return 1
    n = 0
    for ch in payload.get("choices") or []:
        if not isinstance(ch, dict):
            continue
        delta = ch.get("delta") or {}
        text = delta.get("content") if isinstance(delta, dict) else None
        if not text and isinstance(ch.get("text"), str):
            text = ch["text"]
        if text:
            n += 1
    return n


def summarize(rec: StreamRecord) -> StreamSummary:
    parks = resumes = recomputes = keepalives = pings = tokens = 0
    server_tokens: int | None = None
    done = False
    error = rec.error
    tracker = ParkTracker()  # the same park bookkeeping as the sidecar's relay
    spans: list[tuple[float, float]] = []
    ka_times: list[float] = []
    token_times: list[float] = []
    for t, text in rec.lines:
        if text.startswith(":"):
            notice = classify(text[1:].encode("utf-8", "replace"))
            change = tracker.apply(notice, t)
            if isinstance(change, ParkEnded):
                spans.append((change.since, t))
            kind = notice.kind
            if kind is NoticeKind.PREEMPTED:
                parks += 1
            elif kind is NoticeKind.RESUMED:
                resumes += 1
            elif kind is NoticeKind.RECOMPUTED:
                recomputes += 1
            elif kind is NoticeKind.PREEMPT_KEEPALIVE or text[1:].strip() == "keepalive":
                keepalives += 1  # the server's, or the sidecar's own idle keepalive
                ka_times.append(t)
            elif kind is NoticeKind.PING:
                pings += 1
            continue
        if not text.startswith("data:"):
            continue
        data = text[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            payload = json.loads(data)
        except ValueError:
            continue
        if isinstance(payload, dict):
            # The server's own count in the final event: events carry pieces of text, and
            # a token that ends inside a UTF-8 character sends no text of its own.
            timings = payload.get("timings")
            if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
                server_tokens = timings["predicted_n"]
            if payload.get("error"):
                err = payload["error"]
                error = error or (err.get("message") if isinstance(err, dict) else str(err))
            if payload.get("stop") is True:
                done = True
        n = _event_tokens(payload)
        if n:
            tokens += n
            token_times.append(t)
    for ended in tracker.close(rec.t_end):  # parked until the end
        spans.append((ended.since, rec.t_end))
    spans.sort()

    stamps = [rec.t_headers if rec.t_headers is not None else rec.t_start]
    stamps += [t for t, _ in rec.lines] + [rec.t_end]
    silence = max((b - a for a, b in itertools.pairwise(stamps)), default=0.0)
    ttft = token_times[0] - rec.t_start if token_times else None
    if server_tokens is not None:
        tokens = server_tokens
    tps = None
    if len(token_times) >= 2 and token_times[-1] > token_times[0]:
        tps = (tokens - 1) / (token_times[-1] - token_times[0])
    if error == INTERRUPTED and done:
        error = None  # it had finished; only the connection close was cut short
    if rec.status is not None and rec.status != 200 and error is None:
        error = f"HTTP {rec.status}: " + " ".join(text for _, text in rec.lines)[:200]
    outcome = "error" if error or rec.status != 200 else ("done" if done else "truncated")
    return StreamSummary(
        index=rec.index,
        status=rec.status,
        outcome=outcome,
        tokens=tokens,
        ttft_s=ttft,
        tokens_per_s=tps,
        parks=parks,
        resumes=resumes,
        recomputes=recomputes,
        keepalives=keepalives,
        pings=pings,
        parked_s=sum(b - a for a, b in spans),
        longest_silence_s=silence,
        duration_s=rec.t_end - rec.t_start,
        park_spans=spans,
        keepalive_times=ka_times,
        token_times=token_times,
        error=error,
    )


def totals(summaries: list[StreamSummary]) -> dict[str, Any]:
    return {
        "streams": len(summaries),
        "done": sum(s.outcome == "done" for s in summaries),
        "tokens": sum(s.tokens for s in summaries),
        "parks": sum(s.parks for s in summaries),
        "resumes": sum(s.resumes for s in summaries),
        "recomputes": sum(s.recomputes for s in summaries),
        "keepalives": sum(s.keepalives for s in summaries),
        "pings": sum(s.pings for s in summaries),
        "longest_silence_s": max((s.longest_silence_s for s in summaries), default=0.0),
        "longest_stream_s": max((s.duration_s for s in summaries), default=0.0),
    }


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


COLUMNS = ("stream", "status", "outcome", "tokens", "ttft_s", "tok/s", "parks", "resumes",
           "recomp", "keepalives", "pings", "parked_s", "silence_s")  # fmt: skip


def table(summaries: list[StreamSummary]) -> str:
    """The summary as an aligned text table, one row per stream plus a total."""
    rows = [list(COLUMNS)]
    for s in summaries:
        rows.append([
            f"#{s.index}", str(s.status or "-"), s.outcome, str(s.tokens), _fmt(s.ttft_s),
            _fmt(s.tokens_per_s, ".1f"), str(s.parks), str(s.resumes), str(s.recomputes),
            str(s.keepalives), str(s.pings), _fmt(s.parked_s), _fmt(s.longest_silence_s),
        ])  # fmt: skip
    t = totals(summaries)
    rows.append([
        "total", "", f"{t['done']}/{t['streams']} done", str(t["tokens"]), "", "",
        str(t["parks"]), str(t["resumes"]), str(t["recomputes"]), str(t["keepalives"]),
        str(t["pings"]), _fmt(sum(s.parked_s for s in summaries)),
        _fmt(t["longest_silence_s"]),
    ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    )


def to_json(
    opts: ProbeOptions, records: list[StreamRecord], summaries: list[StreamSummary]
) -> dict[str, Any]:
    out_streams = []
    for rec, s in zip(records, summaries, strict=True):
        d = asdict(s)
        d.pop("token_times")
        d["lines"] = [{"t": round(t, 4), "text": text} for t, text in rec.lines]
        out_streams.append(d)
    return {
        "url": endpoint_url(opts.url),
        "request": build_body(endpoint_url(opts.url), opts),
        "streams": out_streams,
        "totals": totals(summaries),
    }


def plot(summaries: list[StreamSummary], path: Path, title: str = "") -> None:
    """One lane per stream: tokens as ticks, parks shaded, keepalives and pings marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = len(summaries)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.7 * max(n, 1)))
    for lane, s in enumerate(summaries):
        y = n - 1 - lane
        if s.token_times:
            ax.hlines(y, s.token_times[0], s.token_times[-1], color="0.85", lw=6, zorder=1)
        if s.park_spans:
            ax.broken_barh([(a, max(b - a, 1e-3)) for a, b in s.park_spans], (y - 0.4, 0.8),
                           facecolors="tab:orange", alpha=0.35, zorder=0)  # fmt: skip
        if s.token_times:
            ax.plot(s.token_times, [y] * len(s.token_times), "|", color="tab:blue", ms=9,
                    zorder=2)  # fmt: skip
        if s.keepalive_times:
            ax.plot(s.keepalive_times, [y + 0.28] * len(s.keepalive_times), "v",
                    color="tab:red", ms=5, zorder=3)  # fmt: skip
        if s.outcome != "done" and s.token_times:
            ax.plot([s.token_times[-1]], [y], "x", color="black", ms=10, zorder=4)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"#{s.index} ({s.outcome})" for s in reversed(summaries)])
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlabel("seconds since the probe started")
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Line2D([], [], marker="|", ls="", color="tab:blue", ms=9, label="token"),
        Patch(facecolor="tab:orange", alpha=0.35, label="parked"),
        Line2D([], [], marker="v", ls="", color="tab:red", label="keepalive"),
    ]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    t = totals(summaries)
    ax.set_title(
        title
        or f"{t['streams']} streams: {t['parks']} parks, {t['resumes']} resumes, "
        f"{t['keepalives']} keepalives, longest silence {t['longest_silence_s']:.2f}s",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

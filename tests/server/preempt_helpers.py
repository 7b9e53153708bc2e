"""Client helpers for the KV preemption tests and benchmarks.

Small synchronous wrappers around llama-server's HTTP API: completions (streamed or not) that
record everything a test needs to compare runs, Prometheus metrics parsed into a dict, /slots,
and a poller that waits for a condition read from the server instead of sleeping.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.llama import parse_metrics
from tests.support.procs import wait_until
from tests.support.sse_client import iter_lines
from tests.support.tinymodel import TEXT_TOKENS

CONTEXT_ERROR = "Context size has been exceeded."
# a swap park's log line: the state's MiB and the ms its save took
PARK_RE = re.compile(r"state ([0-9.]+) MiB saved to host RAM in ([0-9.]+) ms")

# server flags shared by the preemption tests: unified KV, metrics and /slots, one thread
BASE = ["--kv-unified", "--metrics", "--slots", "-t", "1", "-tb", "1", "--no-warmup"]
PARK = ["--preempt-ram", "8192"]
# the parked head waits 0 s (not 2) before a context-shifting resident is rotated out, so that a
# rotation test does not depend on how many tokens the model makes in 2 s
ROTATE_NOW = {"LLAMA_SERVER_PREEMPT_ROTATE_S": "0"}

# log lines with stable prefixes (docs/preemption.md, "Observability")
PARK_LINE = "preempted: "
RESUME_LINE = "resumed after "
ON_REQUEST_LINE = "preempted on request after "
LAST_RESORT_LINE = "preempted as a last resort"
ROTATION_LINE = "rotated out after "
REWIND_LINE = "to the cache boundary"  # with ", back to prompt processing" for a prompt chunk
PREEMPT_LOG_MARKERS = (
    PARK_LINE,
    RESUME_LINE,
    ON_REQUEST_LINE,
    LAST_RESORT_LINE,
    ROTATION_LINE,
    "to re-prefill",
)


@dataclass
class Completion:
    """What one /completion request produced."""

    status: int = 0
    content: str = ""
    tokens: list[int] = field(default_factory=list)
    final: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    cancelled: bool = False
    n_events: int = 0
    t_start: float = 0.0  # time.monotonic() at the request
    t_events: list[float] = field(default_factory=list)  # arrival of each data event, since t_start
    t_end: float = 0.0  # end of the response, since t_start

    @property
    def longest_wait(self) -> float:
        """Longest silence of the stream: request to first event, or between two events."""
        marks = [0.0, *self.t_events]
        return max((b - a for a, b in itertools.pairwise(marks)), default=self.t_end)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.final is not None

    @property
    def error_message(self) -> str:
        if self.error is None:
            return ""
        return str(self.error.get("message", self.error))

    @property
    def n_predicted(self) -> int:
        return int(self.final["tokens_predicted"]) if self.final else -1

    @property
    def preempt(self) -> dict[str, int]:
        return dict(self.final.get("preempt", {})) if self.final else {}

    @property
    def timings(self) -> dict[str, Any]:
        return dict(self.final.get("timings", {})) if self.final else {}


def completion_body(
    prompt: str | list[int] | list[list[int]], n_predict: int, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0.0,
        "top_k": 1,
        "seed": 42,
        "ignore_eos": True,
        "return_tokens": True,
        "cache_prompt": False,
        # no byte tokens: a byte that leaves UTF-8 incomplete is streamed without its token (and
        # without its probabilities), so banning them keeps token lists and probs complete
        "logit_bias": BAN_BYTE_TOKENS,
    }
    body.update(extra)
    return body


def complete(
    url: str,
    prompt: str | list[int],
    n_predict: int,
    *,
    stream: bool = True,
    timeout: float = 120.0,
    cancel_after_events: int | None = None,
    cancel_event: threading.Event | None = None,
    **extra: Any,
) -> Completion:
    """POST /completion and collect the result. A stream can be cancelled (connection closed)
    after a number of data events or when `cancel_event` is set."""
    body = completion_body(prompt, n_predict, stream=stream, **extra)
    out = Completion(t_start=time.monotonic())
    try:
        _complete(out, url, body, stream, timeout, cancel_after_events, cancel_event)
    finally:
        out.t_end = time.monotonic() - out.t_start
    return out


def _complete(
    out: Completion,
    url: str,
    body: dict[str, Any],
    stream: bool,
    timeout: float,
    cancel_after_events: int | None,
    cancel_event: threading.Event | None,
) -> None:
    with httpx.Client(timeout=timeout) as client:
        if not stream:
            r = client.post(f"{url}/completion", json=body)
            out.status = r.status_code
            data = r.json()
            if r.status_code != 200 or "error" in data:
                out.error = data.get("error", data)
            else:
                out.final = data
                out.content = data.get("content", "")
                out.tokens = list(data.get("tokens", []))
            return
        with client.stream("POST", f"{url}/completion", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                r.read()
                try:
                    out.error = r.json().get("error", {"message": r.text})
                except ValueError:
                    out.error = {"message": r.text}
                return
            for line in iter_lines(r.iter_raw()):
                if cancel_event is not None and cancel_event.is_set():
                    out.cancelled = True
                    return
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                out.n_events += 1
                out.t_events.append(time.monotonic() - out.t_start)
                if "error" in event:
                    out.error = event["error"]
                    break
                out.content += event.get("content", "")
                out.tokens.extend(event.get("tokens", []))
                if event.get("stop"):
                    out.final = event
                    break
                if cancel_after_events is not None and out.n_events >= cancel_after_events:
                    out.cancelled = True
                    return


def run_concurrently(calls: Iterable[Callable[[], Any]], stagger: float = 0.0) -> list[Any]:
    """Run the calls on threads, started in order (optionally staggered); results in order."""
    calls = list(calls)
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def runner(i: int, fn: Callable[[], Any]) -> None:
        try:
            results[i] = fn()
        except BaseException as e:  # surfaced below, in the test's thread
            errors.append(e)

    threads = [
        threading.Thread(target=runner, args=(i, fn), daemon=True) for i, fn in enumerate(calls)
    ]
    for t in threads:
        t.start()
        if stagger:
            time.sleep(stagger)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def metrics(url: str) -> dict[str, float]:
    """`/metrics` (needs --metrics) as {name without the llamacpp: prefix: value}."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    return parse_metrics(r.text)


def slots(url: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/slots", timeout=10)
    r.raise_for_status()
    return list(r.json())


def n_decoded_max(url: str) -> int:
    """Tokens generated so far by the furthest running request (/slots)."""
    return max(
        (s["next_token"][0]["n_decoded"] for s in slots(url) if s["is_processing"]), default=0
    )


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.02,
    what: str = "condition",
) -> Any:
    """Poll `predicate` until it returns something truthy (returned); fail on timeout."""
    return wait_until(predicate, timeout, what, every=interval)


def wait_settled(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Wait until no slot is processing and no request is parked; return the metrics then."""

    def settled() -> dict[str, float] | None:
        m = metrics(url)
        if m.get("requests_processing", 1) == 0 and m.get("requests_preempted", 1) == 0:
            return m
        return None

    return wait_for(settled, timeout=timeout, what="an idle server")


# the generated test models' vocabulary: 3 specials, 256 byte tokens, then the text pieces
FIRST_TEXT_TOKEN = TEXT_TOKENS[0]
LAST_TEXT_TOKEN = TEXT_TOKENS[-1]


BAN_BYTE_TOKENS = [[i, False] for i in range(3, FIRST_TEXT_TOKEN)]


def token_prompt(n: int, seed: int) -> list[int]:
    """A prompt of exactly n token ids (a token list gets no BOS), deterministic per seed."""
    rng = random.Random(seed)
    return [rng.randint(FIRST_TEXT_TOKEN, LAST_TEXT_TOKEN) for _ in range(n)]


def count_lines(log: str, marker: str) -> int:
    return sum(1 for line in log.splitlines() if marker in line)


def preempt_log_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if any(m in line for m in PREEMPT_LOG_MARKERS)]


class RawStream:
    """A streaming /completion on a plain socket, read on a thread, that the test can cut at any
    moment (even while the server sends nothing, as when the slot is parked): `cancel()` shuts the
    connection down, which is how a client that goes away looks to the server."""

    def __init__(self, url: str, prompt: str | list[int], n_predict: int, **extra: Any) -> None:
        import socket
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        body = json.dumps(completion_body(prompt, n_predict, stream=True, **extra)).encode()
        head = (
            f"POST /completion HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=300)
        self.sock.sendall(head + body)
        self.data = b""
        self.closed_by_server = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    self.closed_by_server = True
                    return
                self.data += chunk
        except OSError:
            return

    def n_data_events(self) -> int:
        return self.data.count(b"data: ")

    def cancel(self) -> None:
        import socket

        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(10)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def complete_many(
    url: str,
    prompts: list[list[int]],
    n_predict: int,
    *,
    stream: bool = True,
    timeout: float = 300.0,
    **extra: Any,
) -> list[Completion]:
    """One /completion request with several prompts: the server queues their tasks together, so
    they start in the same iteration however fast the model is. Returns one Completion per prompt
    (a streamed event names its prompt in "index"); a request-level error lands in every entry."""
    body = completion_body(prompts, n_predict, stream=stream, **extra)  # type: ignore[arg-type]
    outs = [Completion(t_start=time.monotonic()) for _ in prompts]
    with httpx.Client(timeout=timeout) as client:
        if not stream:
            r = client.post(f"{url}/completion", json=body)
            data = r.json()
            for out in outs:
                out.status = r.status_code
            if r.status_code != 200 or (isinstance(data, dict) and "error" in data):
                for out in outs:
                    out.error = data.get("error", data)
                return outs
            items = data if isinstance(data, list) else [data]
            for item in items:
                out = outs[int(item.get("index", 0))]
                out.final = item
                out.content = item.get("content", "")
                out.tokens = list(item.get("tokens", []))
            return outs
        with client.stream("POST", f"{url}/completion", json=body) as r:
            for out in outs:
                out.status = r.status_code
            if r.status_code != 200:
                r.read()
                for out in outs:
                    out.error = r.json().get("error", {"message": r.text})
                return outs
            for line in iter_lines(r.iter_raw()):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if not isinstance(event, dict):
                    continue  # the empty "begin" result of a prompt other than the first
                if "error" in event:
                    for out in outs:
                        if out.final is None:
                            out.error = event["error"]
                    break
                out = outs[int(event.get("index", 0))]
                out.n_events += 1
                out.t_events.append(time.monotonic() - out.t_start)
                out.content += event.get("content", "")
                out.tokens.extend(event.get("tokens", []))
                if event.get("stop"):
                    out.final = event
    for out in outs:
        out.t_end = time.monotonic() - out.t_start
    return outs


def top2_gaps(probs: list[dict[str, Any]]) -> list[float]:
    """Per generated token, its top logprob minus the runner-up's (a response's
    `completion_probabilities`, asked with n_probs >= 2)."""
    return [p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"] for p in probs]


def _greedy_gaps(url: str, prompt: Any, n_predict: int) -> tuple[Completion, list[float]]:
    """`prompt`'s greedy continuation on `url` (a non-streamed Completion) and its top2_gaps()."""
    body = completion_body(prompt, n_predict, stream=False, n_probs=2)
    out = Completion(t_start=time.monotonic())
    r = httpx.post(f"{url}/completion", json=body, timeout=120)
    out.t_end = time.monotonic() - out.t_start
    out.status = r.status_code
    data = r.json()
    assert r.status_code == 200, data
    assert "error" not in data, data
    out.final = data
    out.content = data.get("content", "")
    out.tokens = list(data.get("tokens", []))
    return out, top2_gaps(data["completion_probabilities"])


def tie_free(url: str, prompt: Any, n_predict: int, min_gap: float) -> bool:
    """Whether `prompt`'s greedy continuation of `n_predict` tokens on `url` never has its top two
    logprobs closer than `min_gap` (see robust_prompts())."""
    _, gaps = _greedy_gaps(url, prompt, n_predict)
    return len(gaps) == n_predict and min(gaps) >= min_gap


# prompts whose greedy path has no near-tie, per (count, length, n_predict, first_seed)
_ROBUST: dict[tuple[int, int, int, int], list[list[int]]] = {}


def robust_prompts(
    url: str, count: int, length: int, n_predict: int, *, first_seed: int = 0, min_gap: float = 0.02
) -> list[list[int]]:
    """`count` token prompts whose greedy continuation of `n_predict` tokens never has its top two
    logprobs closer than `min_gap`.

    A random-weight model has occasional near-ties; any change of batch shape or KV cell layout
    (another slot parked or restored changes the attention window) moves logits by float noise and
    can flip such a tie. "Identical to the solo run" is a fair test of a park only away from ties,
    so the comparisons use prompts picked here (the same for every server with the same model)."""
    key = (count, length, n_predict, first_seed)
    if key in _ROBUST:
        return _ROBUST[key]
    return [p for p, _ in robust_solo_runs(url, count, length, n_predict,
                                           first_seed=first_seed, min_gap=min_gap)]  # fmt: skip


def robust_solo_runs(
    url: str, count: int, length: int, n_predict: int, *, first_seed: int = 0, min_gap: float = 0.02
) -> list[tuple[list[int], list[int]]]:
    """robust_prompts() with each prompt's solo tokens on `url`: those of the request that checked
    the prompt for ties (asking for token probabilities changes no token), so that a test needs no
    second solo run; a solo run each when the prompts were picked before."""
    runs = robust_solo_completions(url, count, length, n_predict, first_seed=first_seed,
                                   min_gap=min_gap)
    return [(p, c.tokens) for p, c in runs]


def robust_solo_completions(
    url: str, count: int, length: int, n_predict: int, *, first_seed: int = 0, min_gap: float = 0.02
) -> list[tuple[list[int], Completion]]:
    """robust_solo_runs() with each solo run's whole Completion (not streamed when it is the
    request that checked the prompt), for a test that compares more than the tokens."""
    key = (count, length, n_predict, first_seed)
    if key in _ROBUST:
        runs = [(p, complete(url, p, n_predict)) for p in _ROBUST[key]]
        assert all(c.ok for _, c in runs), [c.error for _, c in runs]
        return runs
    out: list[tuple[list[int], Completion]] = []
    seed = first_seed
    while len(out) < count:
        assert seed < first_seed + 300, (
            f"no {count} tie-free prompts of {length} tokens for {n_predict} tokens"
        )
        prompt = token_prompt(length, seed)
        seed += 1
        solo, gaps = _greedy_gaps(url, prompt, n_predict)
        if len(gaps) == n_predict and min(gaps) >= min_gap:
            out.append((prompt, solo))
    _ROBUST[key] = [p for p, _ in out]
    return out


PARK_SECONDS = 5.0


def long_park_sizes(
    start_server: Callable[..., Any],
    model: Any,
    min_pool: int = 256,
    park_s: float = PARK_SECONDS,
) -> tuple[int, int, int]:
    """(pool, leader tokens, parked tokens) for a park of about ``park_s`` on this machine.

    B starts when A holds a few tokens; both grow until the pool is full at about half each;
    B (the smaller) is parked until A finishes. The park therefore lasts (A - pool/2) tokens
    of A generating alone: sizing it from the measured speed keeps tests that need a long park
    meaningful on a machine of any speed (fixed sizes gave sub-second parks on a GPU), and
    short on a slow one. ``min_pool`` (cells) makes it longer there.
    """
    probe = start_server(model=model, args=[*BASE, "-c", "256", "-np", "1"])
    solo = complete(probe.url, token_prompt(8, 1), 32)
    probe.stop()
    assert solo.final is not None, solo.error
    speed = float(solo.final["timings"]["predicted_per_second"])
    # llama.cpp pads the context to a multiple of 256: size the pool on that grid
    pool = max(min_pool, -(-int(2 * park_s * speed + 64) // 256) * 256)
    return pool, pool - 32, pool // 2 + 44

"""The fixed-deadline wait in `server_response::recv_with_timeout`.

Stream A generates while stream B prefills a long prompt in 64-token batches. B's stream
opens when its slot starts, then B gets no result until its first token, while A's results
wake the shared condition variable many times a second. With a deadline-based wait B gets
a ping about every second; stock restarts the wait at every wakeup and B hears nothing.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import StartServer
from tests.support.llama import LlamaServer
from tests.support.sse_client import StreamLog

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.serial]

ARGS = ["-c", "32768", "-np", "2", "--kv-unified", "-b", "64", "-ub", "64",
        "--sse-ping-interval", "1", "-t", "1", "-tb", "1"]
# the prefill's cost grows with about the square of its length: 16,000 tokens take 5.7 s of CPU
# (25,000 take 14.8 s), still well over the 3 s the scenario needs
LONG_PROMPT = [1] + [259 + (i * 7919) % 180 for i in range(16_000)]


def busy_prefill(srv: LlamaServer) -> tuple[StreamLog, list[float]]:
    """Run the A/B scenario; return B's stream and the arrival times of A's data lines."""
    a_times: list[float] = []
    a_started = threading.Event()
    stop_a = threading.Event()

    def run_a() -> None:
        import httpx

        body = {"prompt": "hello", "n_predict": 8000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/completion", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    a_times.append(time.monotonic())
                    a_started.set()
                if stop_a.is_set():
                    return  # closing the connection cancels A's task

    ta = threading.Thread(target=run_a, daemon=True)
    ta.start()
    assert a_started.wait(30), "stream A never produced a token"
    b = srv.stream("/completion", {"prompt": LONG_PROMPT, "n_predict": 2, "stream": True})
    stop_a.set()
    ta.join(30)
    return b, a_times


def prefill_window(b: StreamLog) -> tuple[float, float, list[tuple[float, str]]]:
    first_data = next(t for t, ln in b.lines if ln.startswith("data: "))
    pings = [(t, ln) for t, ln in b.lines if ln == ":" and t < first_data]
    return b.t_headers, first_data, pings


def check_scenario(b: StreamLog, a_times: list[float]) -> tuple[float, int]:
    assert b.status == 200, b.body()
    start, end, pings = prefill_window(b)
    window = end - start
    # The scenario only proves something if B waited long and A kept the queue busy.
    assert window >= 3.0, f"B's prefill took only {window:.2f}s: make the prompt longer"
    a_during = [t - b.t_start for t in a_times if start < t - b.t_start < end]
    assert len(a_during) >= 10 * window, f"A produced only {len(a_during)} tokens during B's wait"
    return window, len(pings)


def test_pings_reach_a_waiting_stream_on_a_busy_server(start_server: StartServer) -> None:
    srv = start_server(args=ARGS)
    b, a_times = busy_prefill(srv)
    window, n_pings = check_scenario(b, a_times)
    # One ping per second of waiting, give or take the edges of the window.
    assert n_pings >= int(window) - 1, f"{n_pings} pings in a {window:.1f}s wait"
    _, _, pings = prefill_window(b)
    gaps = [b2 - b1 for (b1, _), (b2, _) in itertools.pairwise(pings)]
    assert max(gaps, default=0) < 2.5, f"pings spaced {gaps}"


@pytest.mark.stock
def test_stock_server_starves_pings_while_busy(start_server: StartServer,
                                               stock_server_bin: Path) -> None:
    """The bug being fixed, shown on the pinned stock source (proves the test above)."""
    srv = start_server(args=ARGS, binary=stock_server_bin)
    b, a_times = busy_prefill(srv)
    window, n_pings = check_scenario(b, a_times)
    # A ping can slip through only when the busy stream itself stalls for a whole second
    # (a descheduled process on a loaded machine); the patched server sends one every second.
    assert n_pings <= window / 5, (
        f"stock sent {n_pings} pings in {window:.1f}s: has upstream fixed the wait?")

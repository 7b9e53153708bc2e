"""Real nginx with docs/nginx.conf in front of `up` and the real patched llama-server: a pair
of streams parked behind an endless resident (tests/support/resident.py) completes through
nginx although nginx's proxy_read_timeout is shorter than the park (llama-server's own pings
are off, so only the sidecar's keepalives can cover it; the park lengths come from
llama-server's log).
test_nginx_fake.py holds the control (the same park, minus the sidecar, is cut).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import RunUp
from tests.support.nginx import NGINX, start_nginx
from tests.support.resident import endless_resident, token_prompt
from tests.support.sse_client import StreamLog, stream_sse

pytestmark = [
    pytest.mark.server,
    pytest.mark.slow,
    pytest.mark.nginx,
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)"),
]

# The sidecar's keepalives come eight times per read timeout; the resident is cut once a park
# has lasted half as long again. (At 0.5 s a loaded machine let a stream wait longer than the
# timeout for its head: a launch waits for the iteration that prefills the resident.)
READ_TIMEOUT_S = 1.0
KEEPALIVE_S = 0.125
HOLD_S = 1.5 * READ_TIMEOUT_S
# Two streams of 165 prompt tokens in a 256-cell pool of three slots: the second waits for the
# first (parked with 0 cells), the resident's 64 fit beside one of them, and with both
# generating that stream is parked a few tokens into its reply holding more than the 129 cells
# a context shift leaves the resident: it stays parked until the resident is cut.
POOL = ("--parallel", "3", "--ctx-size", "256", "--preempt-ram", "8192")
PROMPT = token_prompt(165, start=1)
TOKENS = 20


def server_park_lengths(log_text: str) -> list[float]:
    """Park lengths from llama-server's log (`resumed after X s`, docs/preemption.md)."""
    return [float(x) for x in re.findall(r"resumed after ([0-9.]+) s", log_text)]


def test_overflowing_pair_completes_through_nginx_with_a_short_read_timeout(
    run_preempting_up: RunUp, slow_model: Path, tmp_path: Path
) -> None:
    env = {"LLAMA_SIDECAR_PARK_KEEPALIVE": f"{KEEPALIVE_S:g}",
           "LLAMA_SIDECAR_IDLE_KEEPALIVE": f"{KEEPALIVE_S:g}"}  # fmt: skip
    up = run_preempting_up("--model", str(slow_model), *POOL, "--ping-interval", "-1",
                           "--", "-t", "1", "--context-shift", env=env)  # fmt: skip
    nginx = start_nginx(tmp_path / "nginx", up.port, read_timeout=f"{READ_TIMEOUT_S * 1e3:.0f}ms")
    try:
        body = {"prompt": PROMPT, "n_predict": TOKENS, "ignore_eos": True, "stream": True,
                "temperature": 0}  # fmt: skip
        logs: list[StreamLog] = []

        def run() -> None:
            logs.append(stream_sse(nginx.url + "/completion", body, timeout=600))

        # the prompt in a slot's cache, so the first stream's head comes at its first token (a
        # cold prefill of 165 tokens can outlast the read timeout on a loaded machine)
        warm = {**body, "n_predict": 1, "stream": False}
        r = httpx.post(up.server_url + "/completion", json=warm, timeout=60)
        assert r.status_code == 200, r.text
        threads = [threading.Thread(target=run) for _ in range(2)]
        with endless_resident(up.server_url, up.server_log, HOLD_S):
            for th in threads:
                th.start()
            for th in threads:
                th.join(600)
    finally:
        nginx.stop()
    assert len(logs) == 2
    for log in logs:
        assert log.status == 200, (log.error, nginx.error_log())
        assert log.error is None, (log.error, nginx.error_log())
        final = log.final()
        assert final, log.body()[-2000:]
        assert final.get("stop") is True, log.body()[-2000:]
        assert final["timings"]["predicted_n"] == TOKENS
    parks = server_park_lengths(up.server_log.read_text(errors="replace"))
    assert parks, "no stream was parked: the pair did not overflow the pool"
    assert max(parks) > READ_TIMEOUT_S, f"parks {parks} did not outlast proxy_read_timeout"
    assert "upstream timed out" not in nginx.error_log()

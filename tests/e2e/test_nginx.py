"""Real nginx with docs/nginx.conf in front of `up` and the real patched llama-server: an
overflowing pair of streams completes through nginx although nginx's proxy_read_timeout
is shorter than the park (llama-server's own pings are off, so only the sidecar's
keepalives can cover it; the park lengths come from llama-server's log).
test_nginx_fake.py holds the control (the same park, minus the sidecar, is cut).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from tests.e2e.conftest import RunUp
from tests.support.nginx import NGINX, start_nginx
from tests.support.sse_client import StreamLog, stream_sse

pytestmark = [
    pytest.mark.server,
    pytest.mark.slow,
    pytest.mark.nginx,
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)"),
]

# The sidecar's keepalives come four times per read timeout.
READ_TIMEOUT_S = 0.5
KEEPALIVE_S = 0.125
# Two streams of 480 tokens (after a prompt of 14) in a 512-cell pool: they collide at ~250
# tokens each, and the parked one waits while the other makes ~240 more, 1.3 s (2.6 read
# timeouts) even where the slow model runs at 180 tokens/s alone (360 tokens in 384 cells gave
# parks of 0.95 s there).
POOL = ("--parallel", "2", "--ctx-size", "512", "--preempt-ram", "8192")
TOKENS = 480


def server_park_lengths(log_text: str) -> list[float]:
    """Park lengths from llama-server's log (`resumed after X s`, PREEMPTION.md §9)."""
    return [float(x) for x in re.findall(r"resumed after ([0-9.]+) s", log_text)]


def test_overflowing_pair_completes_through_nginx_with_a_short_read_timeout(
    run_preempting_up: RunUp, slow_model: Path, tmp_path: Path
) -> None:
    env = {"LLAMA_SIDECAR_PARK_KEEPALIVE": f"{KEEPALIVE_S:g}",
           "LLAMA_SIDECAR_IDLE_KEEPALIVE": f"{KEEPALIVE_S:g}"}  # fmt: skip
    up = run_preempting_up("--model", str(slow_model), *POOL, "--ping-interval", "-1",
                           "--", "-t", "1", env=env)  # fmt: skip
    nginx = start_nginx(tmp_path / "nginx", up.port, read_timeout=f"{READ_TIMEOUT_S * 1e3:.0f}ms")
    try:
        body = {"prompt": "Once upon a time", "n_predict": TOKENS, "ignore_eos": True,
                "stream": True, "temperature": 0}  # fmt: skip
        logs: list[StreamLog] = []

        def run() -> None:
            logs.append(stream_sse(nginx.url + "/completion", body, timeout=600))

        threads = [threading.Thread(target=run) for _ in range(2)]
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

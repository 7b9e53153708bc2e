"""docs/nginx.conf in a real nginx, in front of `up` with a stand-in llama-server.

The stand-in parks each stream for 2 s in total silence (no server keepalives), and
nginx's proxy_read_timeout is cut to 1 s: through the sidecar the stream completes
(the sidecar writes `: preempt-keepalive` while parked); straight to the server, nginx
cuts it, which shows the test measures what it claims. test_nginx.py does the same with
the real patched server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.llama import parse_metrics
from tests.support.nginx import NGINX, Nginx, pairs_config, start_nginx
from tests.support.procs import free_port
from tests.support.sse_client import StreamLog, stream_sse
from tests.support.up import UpProcess

pytestmark = [
    pytest.mark.nginx,
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)"),
]

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}
# The park is two read timeouts; the sidecar's keepalive comes six times per read timeout, so a
# sidecar kept off the CPU for most of a second by a busy machine still beats the timeout.
PARK_S = 2.0
READ_TIMEOUT = "1s"


@pytest.fixture(scope="module")
def parked_up(tmp_path_factory: pytest.TempPathFactory,
              fake_server_bin: Path) -> Iterator[UpProcess]:  # fmt: skip
    """One `up` for the module: each test puts its own nginx in front of it."""
    tmp_path = tmp_path_factory.mktemp("parked-up")
    model = tmp_path / "fake.gguf"
    model.write_bytes(b"GGUF")
    env = {"FAKE_PARK_S": str(PARK_S), "FAKE_PARK_KEEPALIVE_S": "0",
           "LLAMA_SIDECAR_PARK_KEEPALIVE": "0.15"}  # fmt: skip
    up = UpProcess(["--server-bin", str(fake_server_bin), "--model", str(model)], tmp_path / "up",
                   env=env)  # fmt: skip
    up.log_dir.mkdir()
    try:
        yield up.start(timeout=60)
    finally:
        up.kill()


@pytest.fixture
def nginx_factory(tmp_path: Path) -> Iterator[list[Nginx]]:
    started: list[Nginx] = []
    yield started
    for n in started:
        n.stop()


def test_silent_park_longer_than_proxy_read_timeout_survives_through_the_sidecar(
    parked_up: UpProcess, nginx_factory: list[Nginx], tmp_path: Path
) -> None:
    nginx = start_nginx(tmp_path / "nginx", parked_up.port, read_timeout=READ_TIMEOUT)
    nginx_factory.append(nginx)
    log = stream_sse(nginx.url + "/v1/chat/completions", BODY, timeout=30)
    assert log.status == 200, (log.error, log.body(), nginx.error_log())
    assert log.done, (log.error, log.body(), nginx.error_log())
    assert len(log.events) == 10
    notices = [ln for _, ln in log.comments]
    assert notices[0] == ": preempted"
    assert notices[-1] == ": resumed"
    assert notices.count(": preempt-keepalive") >= 3  # written by the sidecar
    parked = [t for t, ln in log.comments if ln in (": preempted", ": resumed")]
    assert parked[1] - parked[0] >= PARK_S - 0.2  # the park really outlasted the timeout


def test_control_the_same_park_straight_to_the_server_is_cut_by_nginx(
    parked_up: UpProcess, nginx_factory: list[Nginx], tmp_path: Path
) -> None:
    nginx = start_nginx(tmp_path / "nginx", parked_up.server_port, read_timeout=READ_TIMEOUT)
    nginx_factory.append(nginx)
    log = stream_sse(nginx.url + "/v1/chat/completions", BODY, timeout=30)
    assert not log.done
    assert log.error is not None  # nginx closed the response without its last chunk
    assert "upstream timed out" in nginx.error_log()


def test_deploy_pairs_config_spreads_streams_over_two_pairs(tmp_path: Path,
                                                           fake_server_bin: Path) -> None:
    """docs/deploy/nginx-pairs.conf (least_conn) over two `up` pairs: four concurrent
    streams land two on each pair (each pair's sidecar counts its own)."""
    model = tmp_path / "fake.gguf"
    model.write_bytes(b"GGUF")
    ups = [UpProcess(["--server-bin", str(fake_server_bin), "--model", str(model)],
                     tmp_path / f"pair{i}", env={"FAKE_PARK_S": "1.5"})
           for i in range(2)]  # fmt: skip
    nginx = None
    try:
        for up in ups:
            up.log_dir.mkdir()
        # both pairs start at once
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda up: up.start(timeout=60), ups))
        port = free_port()
        nginx = Nginx(tmp_path / "nginx", pairs_config([u.port for u in ups], port), port)
        nginx.start()
        logs: list[StreamLog] = []
        url = nginx.url + "/v1/chat/completions"
        threads = [threading.Thread(target=lambda: logs.append(stream_sse(url, BODY)))
                   for _ in range(4)]  # fmt: skip
        for th in threads:
            th.start()
            time.sleep(0.2)  # least_conn sees the earlier streams as open connections
        for th in threads:
            th.join(60)
        assert len(logs) == 4, nginx.error_log()
        assert all(log.done for log in logs), nginx.error_log()
        served = []
        for up in ups:
            m = parse_metrics(httpx.get(up.metrics_url, timeout=10).text, "llama_sidecar_")
            served.append(m.get("requests_total{route=/v1/chat/completions,status_class=2xx}"))
        assert served == [2.0, 2.0], served
    finally:
        if nginx is not None:
            nginx.stop()
        for up in ups:
            up.kill()

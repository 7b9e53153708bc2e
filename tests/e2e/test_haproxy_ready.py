"""Two llama-server + sidecar pairs behind a real HAProxy that checks each sidecar's /ready.

Pair 1 is overloaded until it parks a stream: its /ready turns 503, HAProxy marks it down,
new requests go to pair 2, the parked stream still completes, and once the park is over
/ready is back to 200 within the poll interval and pair 1 takes requests again. The stream is
parked behind an endless resident (tests/support/resident.py), cut once the checks during the
park are done: the park lasts as long as they take, on a model of any speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BASE,
    PARK,
    Completion,
    complete,
    metrics,
    token_prompt,
    wait_for,
)
from tests.support.haproxy import HAPROXY, HAProxy
from tests.support.resident import endless_resident
from tests.support.sidecar import SidecarProcess, ephemeral_config, start_subprocess

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get haproxy)"),
]

POLL = 0.2  # the sidecars' --ready-poll
# Pair 1: B's 165 prompt tokens and the resident's 64 fit a 256-cell pool, and with both
# generating B is parked ~10 tokens in, holding more than the 129 cells a context shift leaves
# the resident: it stays parked until the resident is cut.
PAIR1 = [*BASE, *PARK, "-c", "256", "-np", "2", "--context-shift"]
B_PROMPT, B_TOKENS = 165, 32


def ready(sidecar: SidecarProcess) -> httpx.Response:
    assert sidecar.metrics_url is not None
    return httpx.get(sidecar.metrics_url.replace("/metrics", "/ready"), timeout=5)


def port(url: str) -> int:
    p = urlsplit(url).port
    assert p is not None
    return p


def served_by(haproxy: HAProxy, n: int) -> list[str]:
    """Send `n` short completions through HAProxy, one after the other; who served each."""
    out = []
    for i in range(n):
        r = httpx.post(haproxy.url + "/completion", timeout=60,
                       json={"prompt": token_prompt(4, 100 + i), "n_predict": 2})  # fmt: skip
        assert r.status_code == 200, r.text
        out.append(r.headers["x-served-by"])
    return out


@pytest.fixture
def sidecars() -> Iterator[list[SidecarProcess]]:
    started: list[SidecarProcess] = []
    yield started
    for sc in started:
        sc.terminate()


def test_haproxy_steers_new_requests_away_from_a_parking_pair(
    start_server: StartServer, slow_model: Path, sidecars: list[SidecarProcess], tmp_path: Path
) -> None:
    servers = [start_server(model=slow_model, args=PAIR1),
               start_server(args=[*BASE, *PARK, "-c", "256", "-np", "2"])]  # fmt: skip
    for srv in servers:
        sidecars.append(start_subprocess(ephemeral_config(srv.url, ready_poll=POLL)))
    pair_ports = [(port(sc.url), port(sc.metrics_url or "")) for sc in sidecars]
    haproxy = HAProxy(tmp_path / "haproxy", pair_ports)
    haproxy.tmp.mkdir()
    haproxy.start()
    try:
        haproxy.wait_status("pair1", "UP")
        haproxy.wait_status("pair2", "UP")
        assert all(ready(sc).status_code == 200 for sc in sidecars)

        # overload pair 1 directly: the resident leads, B overflows the pool and is parked
        results: dict[str, Completion] = {}
        one = sidecars[0].url

        def run_b() -> None:
            results["b"] = complete(one, token_prompt(B_PROMPT, 1), B_TOKENS, timeout=300)

        tb = threading.Thread(target=run_b, daemon=True)
        assert servers[0].log_path is not None
        with endless_resident(servers[0].url, servers[0].log_path, None) as a:
            tb.start()
            wait_for(lambda: ready(sidecars[0]).status_code == 503, timeout=120,
                     what="/ready 503")  # fmt: skip
            assert "parked" in ready(sidecars[0]).text
            haproxy.wait_status("pair1", "DOWN")
            assert metrics(servers[0].url)["requests_preempted"] >= 1, "the park ended too soon"
            # new work goes to the other pair while pair 1 parks
            assert served_by(haproxy, 4) == ["pair2"] * 4
            assert not a.ended, "the resident ended before the checks during the park"

        # the parked stream finishes untouched, and its leader ran until the test cut it
        tb.join(300)
        assert a.status == 200, a
        assert a.chunks > 0, a
        assert results["b"].ok, results["b"].error
        assert len(results["b"].tokens) == B_TOKENS
        assert results["b"].final is not None
        assert results["b"].final["preempt"]["parks"] >= 1

        # back to ready within the poll interval (plus slack for a loaded machine)
        wait_for(lambda: metrics(servers[0].url)["requests_preempted"] == 0, timeout=30,
                 what="no parked requests")  # fmt: skip
        settled = time.monotonic()
        wait_for(lambda: ready(sidecars[0]).status_code == 200, timeout=10, what="/ready 200")
        back_after = time.monotonic() - settled
        print(f"/ready back to 200 {back_after:.2f} s after the last park ended (poll {POLL} s)")
        assert back_after <= POLL + 2.0
        haproxy.wait_status("pair1", "UP")
        assert "pair1" in served_by(haproxy, 6)
    finally:
        haproxy.stop()

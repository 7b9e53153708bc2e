"""Setting the priority costs the sidecar little, whatever the body: three 30 MiB bodies.

The attack: with a priority rule on, three clients at once upload 30 MiB completion bodies
made of ten million empty objects (``{},{},...``), the shape that costs a JSON parser the
most per byte.  Parsing them held the interpreter for seconds (every stream stalled) and
took 28 times the body in memory.  The splice (sidecar/core/priority.py) scans and copies the
body in bounded steps: the sidecar's peak memory grows by a small multiple of
``--body-buffer``, not of the bodies.  The stall itself is measured beside a parked
stream in the fairness run (tests/hostile/test_fairness.py, docs/benchmarks.md).
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.fake_upstream import fake_upstream_in_thread
from tests.support.sidecar import ephemeral_config, start_subprocess

MiB = 1024 * 1024
BODY_BUFFER = 1 * MiB  # the default
N_OBJECTS = 10 * MiB  # "{}," each: 30 MiB
ATTACKERS = 3
# The sidecar's peak memory may grow by this much per concurrent rewrite: the in-memory
# part of the received body and of its copy (--body-buffer each), read pieces, socket
# buffers, allocator slack.  A parse grew it by about 28 times the body (2.5 GB here).
PER_REWRITE = 16 * BODY_BUFFER


def attack_body() -> bytes:
    return b'{"prompt":"x","n_predict":1,"a":[' + b"{}," * N_OBJECTS + b"{}]}"


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def post(url: str, body: bytes, results: list[bytes]) -> None:
    parts = urlsplit(url)
    assert parts.hostname
    assert parts.port
    with socket.create_connection((parts.hostname, parts.port), timeout=300) as s:
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        s.sendall(body)  # fmt: skip
        got = b""
        while data := s.recv(65536):
            got += data
    results.append(got)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_three_30_mib_rewrites_take_memory_of_the_buffer_not_of_the_bodies() -> None:
    body = attack_body()
    with fake_upstream_in_thread() as fake:
        fake.route("/completion", [("head", 200, [(b"Content-Type", b"application/json")]),
                                   ("send", b'{"content":"ok"}'), ("end",)])  # fmt: skip
        proc = start_subprocess(ephemeral_config(
            fake.url, priority_default=-1, body_buffer=BODY_BUFFER))  # fmt: skip
        try:
            before = peak_rss(proc.pid)
            results: list[bytes] = []
            threads = [threading.Thread(target=post, args=(proc.url, body, results))
                       for _ in range(ATTACKERS)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            grown = peak_rss(proc.pid) - before
            assert proc.alive(), "".join(proc.lines[-30:])
        finally:
            proc.terminate()
        got = [r.body for r in fake.requests if r.method == b"POST"]
    assert len(results) == ATTACKERS
    assert all(r.startswith(b"HTTP/1.1 200 ") for r in results), [r[:80] for r in results]
    assert len(got) == ATTACKERS
    for forwarded in got:
        assert forwarded == body[:-1] + b',"priority":-1}'
    print(f"\npeak RSS grew {grown / MiB:.1f} MiB for {ATTACKERS} x {len(body) / MiB:.0f} MiB")
    assert grown < ATTACKERS * PER_REWRITE, f"peak RSS grew {grown / MiB:.0f} MiB"

"""SIGTERM drain (sidecar in a child process) and 1,000 concurrent streams."""

from __future__ import annotations

import gc
import os
import socket
import threading
import time

import anyio
import httpx
import pytest

from sidecar.server import ephemeral_config, start_subprocess
from tests.proxy.conftest import SidecarFactory
from tests.proxy.fake_upstream import FakeUpstream, chunk, fake_upstream_in_thread, sse_head


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def _stream_in_thread(url: str, out: dict[str, object]) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.Client(timeout=30) as c, c.stream("POST", url, json={"stream": True}) as r:
                data = b""
                for part in r.iter_raw():
                    if not data:
                        out["first"] = time.monotonic()
                    data += part
                out["body"] = data
        except httpx.HTTPError as exc:
            out["error"] = exc
        out["done"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_for(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.mark.slow
def test_sigterm_drains_running_streams() -> None:
    script = [sse_head(), *[x for i in range(20) for x in (("send", chunk(i)), ("sleep", 0.1))],
              ("send", b"data: [DONE]\n\n"), ("end",)]  # fmt: skip
    with fake_upstream_in_thread() as fake:
        fake.route("/v1/chat/completions", script)
        proc = start_subprocess(ephemeral_config(fake.url, drain_timeout=10))
        try:
            out: dict[str, object] = {}
            t = _stream_in_thread(proc.url + "/v1/chat/completions", out)
            _wait_for(lambda: "first" in out)
            sent = time.monotonic()
            proc.proc.send_signal(15)
            _wait_for(lambda: _refused(proc.url), timeout=2)  # new connections refused
            t.join(10)
            assert "error" not in out, out.get("error")
            assert out["body"] == b"".join(chunk(i) for i in range(20)) + b"data: [DONE]\n\n"
            assert proc.proc.wait(10) == 0
            assert time.monotonic() - sent < 10
        finally:
            proc.terminate()


@pytest.mark.slow
def test_sigterm_cuts_streams_after_drain_timeout() -> None:
    script = [
        sse_head(),
        *[x for i in range(100) for x in (("send", chunk(i)), ("sleep", 0.1))],
        ("end",),
    ]
    with fake_upstream_in_thread() as fake:
        fake.route("/v1/chat/completions", script)
        proc = start_subprocess(ephemeral_config(fake.url, drain_timeout=1.0))
        try:
            out: dict[str, object] = {}
            t = _stream_in_thread(proc.url + "/v1/chat/completions", out)
            _wait_for(lambda: "first" in out)
            sent = time.monotonic()
            proc.proc.send_signal(15)
            assert proc.proc.wait(10) == 0
            exited = time.monotonic() - sent
            t.join(5)
            assert 0.9 <= exited <= 5
            assert isinstance(out.get("error"), httpx.RemoteProtocolError)  # cut, not ended cleanly
        finally:
            proc.terminate()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _many_streams(url: str, n: int) -> list[bytes]:
    results: list[bytes] = [b""] * n
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 16\r\n\r\n"
        b'{"stream": true}'
    )

    async def one(i: int) -> None:
        async with await anyio.connect_tcp("127.0.0.1", int(url.rsplit(":", 1)[1])) as s:
            await s.send(request)
            buf = b""
            while not buf.endswith(b"0\r\n\r\n"):
                buf += await s.receive()
            results[i] = buf

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
    return results


@pytest.mark.slow
@pytest.mark.anyio
async def test_thousand_concurrent_streams(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    n = 1000
    fake.route("/v1/chat/completions", [sse_head(), ("send", chunk(0)), ("sleep", 0.5),
               ("send", b": preempted\n\n"), ("sleep", 0.5), ("send", b": resumed\n\n"),
               ("send", chunk(1)), ("end",)])  # fmt: skip
    async with sidecar_factory(fake.url, upstream_max_idle=2000) as sc:
        await _many_streams(sc.url, 20)  # warm up pools and caches
        gc.collect()
        fds0, rss0 = _fds(), _rss()
        results = await _many_streams(sc.url, n)
        assert all(r.startswith(b"HTTP/1.1 200") and b"tok1" in r for r in results)
        assert sc.metrics.parks._value.get() == n + 20
        with anyio.fail_after(5):
            while sc.ctx.active:
                await anyio.sleep(0.01)
        peak = _rss()
        # second round: memory must not grow again (allocator keeps the first round's arenas)
        results = await _many_streams(sc.url, n)
        assert all(b"tok1" in r for r in results)
        await anyio.sleep(0.2)
        gc.collect()
        fds1, rss1 = _fds(), _rss()
        # upstream keep-alive connections stay pooled (1 fd each on our side + 1 on the fake's)
        pooled = len(sc.ctx.upstream._idle)  # type: ignore[attr-defined]
    assert fds1 - 2 * pooled <= fds0 + 5
    assert rss1 <= peak + 8 * 1024 * 1024, (rss0, peak, rss1)
    assert sc.metrics.streams_active._value.get() == 0

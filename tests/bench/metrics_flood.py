"""Benchmark: proxy latency beside a client that loops on ``/metrics``, side by side.

``python -m tests.bench.metrics_flood [--tree DIR ...] [--seconds S] [--rate R]`` runs, for
each source tree given (``--tree /path/to/old/checkout --tree .``), a sidecar from that
tree in its own process in front of the llama-server stand-in
(``tests.support.fake_upstream``, its own process), and measures ``GET /health`` through
the proxy at a fixed rate (8 keep-alive connections, ``--rate`` requests a second in all,
each request timed from send to the end of its response), first alone, then while a
third process sends ``GET /metrics`` on ``--flood-conns`` keep-alive connections (2),
``--flood-rate`` a second in all (0: as fast as it can).  Prints one table row per run
(median, p90, p99, max latency; requests done; scrapes a second; the sidecar's CPU time
over the run's time).
The trees' sidecars get the same flags (those every version has).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONNS = 8
FLOOD_CONNS = 2
SIDECAR_MAIN = "from sidecar.cli.proxy import main; main()"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: bytes) -> int:
    writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: b\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    await reader.readexactly(length)
    return length


async def measure(port: int, seconds: float, rate: float) -> list[float]:
    """Paced GET /health on CONNS connections; the latencies (seconds)."""
    latencies: list[float] = []
    interval = CONNS / rate
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def one(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        due = loop.time() + interval * i / CONNS
        while due < end:
            await asyncio.sleep(max(0.0, due - loop.time()))
            t0 = loop.time()
            await _get(reader, writer, b"/health")
            latencies.append(loop.time() - t0)
            due = max(due + interval, loop.time())  # no catch-up burst after a stall
        writer.close()

    await asyncio.gather(*(one(i) for i in range(CONNS)))
    return latencies


async def flood(port: int, seconds: float, rate: float, conns: int = FLOOD_CONNS) -> int:
    """GET /metrics on ``conns`` connections, ``rate`` a second in all (0: flat out)."""
    done = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    interval = conns / rate if rate > 0 else 0.0

    async def one() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        due = loop.time()
        while loop.time() < end:
            if interval:
                await asyncio.sleep(max(0.0, due - loop.time()))
                due = max(due + interval, loop.time() - 1.0)  # catch up at most 1 s
            await _get(reader, writer, b"/metrics")
            done += 1
        writer.close()

    await asyncio.gather(*(one() for _ in range(conns)))
    return done


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(
    tree: Path,
    upstream_port: int,
    seconds: float,
    rate: float,
    flood_rate: float | None,
    flood_conns: int = FLOOD_CONNS,
) -> dict[str, float]:
    port, mport = free_port(), free_port()
    argv = [sys.executable, "-c", SIDECAR_MAIN, "--upstream", f"http://127.0.0.1:{upstream_port}",
            "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}",
            "--ready-poll", "0", "--log-level", "WARNING"]  # fmt: skip
    sidecar = subprocess.Popen(argv, cwd=tree, stdout=subprocess.DEVNULL)
    flooder = None
    try:
        wait_port(port)
        wait_port(mport)
        if flood_rate is not None:
            args = f"{mport}, {seconds + 1}, {flood_rate}, {flood_conns}"
            code = ("import asyncio, sys; from tests.bench.metrics_flood import flood; "
                    f"print(asyncio.run(flood({args})))")  # fmt: skip
            flooder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO,
                                       stdout=subprocess.PIPE, text=True)  # fmt: skip
            time.sleep(0.5)
        cpu0 = cpu_seconds(sidecar.pid)
        lat = asyncio.run(measure(port, seconds, rate))
        cpu = (cpu_seconds(sidecar.pid) - cpu0) / seconds
        scrapes = 0
        if flooder is not None:
            out, _ = flooder.communicate(timeout=seconds + 30)
            scrapes = int(out.strip() or 0)
    finally:
        sidecar.terminate()
        sidecar.wait(10)
        if flooder is not None and flooder.poll() is None:
            flooder.kill()
    q = statistics.quantiles(lat, n=100)
    return {"p50": q[49], "p90": q[89], "p99": q[98], "max": max(lat), "requests": len(lat),
            "scrapes_per_s": scrapes / (seconds + 1), "cpu": cpu}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, help="a source tree (default: this)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=200.0, help="proxy requests a second")
    ap.add_argument("--flood-rate", type=float, default=400.0, help="scrapes a second, 0: flat out")
    ap.add_argument("--flood-conns", type=int, default=FLOOD_CONNS)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    trees = args.tree or [REPO]
    up_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "tests.support.fake_upstream", "-m", "none", "--host", "127.0.0.1",
         "--port", str(up_port)], cwd=REPO, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_port(up_port)
        print("| tree | /metrics flood | p50 ms | p90 ms | p99 ms | max ms | requests "
              "| scrapes/s | sidecar CPU |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for _ in range(args.rounds):
            for tree in trees:
                for flood_rate in (None, args.flood_rate):
                    r = run(tree, up_port, args.seconds, args.rate, flood_rate, args.flood_conns)
                    print(f"| {tree} | {'no' if flood_rate is None else 'yes'} | "
                          f"{r['p50'] * 1e3:.1f} | {r['p90'] * 1e3:.1f} | {r['p99'] * 1e3:.1f} | "
                          f"{r['max'] * 1e3:.0f} | {r['requests']} | {r['scrapes_per_s']:.0f} | "
                          f"{r['cpu']:.0%} |", flush=True)  # fmt: skip
                    row = {"tree": str(tree), "flood": flood_rate, **r}
                    sys.stderr.write(json.dumps(row) + "\n")
    finally:
        upstream.terminate()
        upstream.wait(10)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

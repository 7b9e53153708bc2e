"""Relay benchmarks: the sidecar vs nginx (proxy_buffering off) vs direct, one run.

Everything runs against the same fast fake upstream (``sidecar_upstream.py``, its
own process); each proxy is its own process so its CPU time can be read from
/proc.  Measured:

* throughput: C concurrent streams of N unthrottled events; events/s and proxy CPU
  seconds per relayed event (ratio to nginx, one worker);
* added latency: 200 streams x 50 events/s; each event carries its send time
  (CLOCK_MONOTONIC ns), the client subtracts it on arrival; p50/p99 minus direct's;
* parked streams: 2,000 streams parked for T s behind the sidecar (1 s park
  keepalive); the worst gap any client saw and the sidecar's peak RSS.

Sidecar variants: event loop uvloop or asyncio (the upstream client is h11; the httpx
client was removed later; the names keep "h11" so runs compare across versions).

``--pin`` (a methodology check, not the default): the fake upstream and this
driver (the load generator) run on CPU 0, every proxy on CPU 1, so a proxy's
queueing is not mixed with the load generator's on a 2-core machine.  Without
it the scheduler places all three processes freely (the figures in
docs/benchmarks.md say which they used).  ``--targets`` limits the run to some
target names (``direct`` is always kept: the latency figures are relative to it);
``--skip-throughput`` measures latency only.  ``--baseline DIR`` adds the sidecar of
another checkout (run by ``DIR/.venv/bin/python`` from DIR, same options) as the target
``sidecar[baseline]``, measured in the same interleaved rounds: a before/after comparison
under the same load.

Usage: python -m benchmarks.sidecar_relay [--quick] [--rounds 3] [--json OUT]
       [--pin] [--targets direct,nginx,sidecar[h11,asyncio]] [--skip-throughput]
       [--baseline ../main]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import ManagedProcess, free_port, line_seen, tcp_listening
from tests.support.sidecar import SidecarProcess, ephemeral_config, start_subprocess

REPO = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def start_upstream() -> tuple[ManagedProcess, int]:
    proc = ManagedProcess(
        [sys.executable, "-m", "benchmarks.sidecar_upstream", "0"], "sidecar_upstream",
        cwd=REPO, ready=line_seen("ready "), poll_every=0.01,
    ).start(30)  # fmt: skip
    line = proc.find_line("ready ")
    assert line is not None
    return proc, int(line.split()[1])


NGINX_CONF = """
daemon off; master_process off; worker_processes 1; worker_rlimit_nofile 20000;
error_log {tmp}/error.log error; pid {tmp}/nginx.pid;
events {{ worker_connections 10000; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/b; proxy_temp_path {tmp}/p; fastcgi_temp_path {tmp}/f;
  uwsgi_temp_path {tmp}/u; scgi_temp_path {tmp}/s;
  upstream up {{ server 127.0.0.1:{up}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_read_timeout 3600s;
    }}
  }}
}}
"""


def start_nginx(up: int, tmp: str) -> tuple[ManagedProcess, int] | None:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        return None
    port = free_port()
    conf = Path(tmp) / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, up=up, port=port))
    proc = ManagedProcess(
        [binary, "-p", tmp, "-c", str(conf), "-e", f"{tmp}/error.log"], "nginx",
        log_path=Path(tmp) / "nginx.out", ready=tcp_listening(port),
        extra_logs=[Path(tmp) / "error.log"],
    ).start(10)  # fmt: skip
    return proc, port


# ----------------------------------------------------------------- client side

TERMINATOR = b"\r\n0\r\n\r\n"
T_RE = re.compile(rb'"t":(\d+)')


async def stream(
    port: int, target: str, lat: list[int] | None = None, gaps: list[float] | None = None
) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    tail = b""
    nbytes = 0
    last = time.monotonic()
    worst = 0.0
    parked = False  # gaps count from the park notice on (not connection setup)
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("closed before the end of the stream")
            now = time.monotonic()
            if parked:
                worst = max(worst, now - last)
            elif gaps is not None and b"preempted" in data:
                parked = True
            last = now
            nbytes += len(data)
            buf = tail + data
            if lat is not None:
                now_ns = time.monotonic_ns()
                cut = buf.rfind(b"\n\n") + 2
                lat.extend(now_ns - int(m) for m in T_RE.findall(buf, 0, cut))
                tail = buf[cut:]
            else:
                tail = buf[-16:]
            if buf.endswith(TERMINATOR):
                break
    finally:
        writer.close()
    if gaps is not None:
        gaps.append(worst)
    return nbytes


async def many(port: int, target: str, n: int, **kw: list) -> float:  # type: ignore[type-arg]
    t0 = time.monotonic()
    await asyncio.gather(*(stream(port, target, **kw) for _ in range(n)))
    return time.monotonic() - t0


@dataclass
class Target:
    name: str
    port: int
    pid: int | None


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def bench_throughput(t: Target, conns: int, events: int, secs: float = 2.0) -> dict[str, float]:
    """``events`` per stream, scaled so one measurement lasts about ``secs``."""
    run(many(t.port, "/tput?n=50", conns))  # warm up pools
    probe = run(many(t.port, f"/tput?n={events // 10}", conns))
    events = int(min(max(events // 10 * conns / probe * secs / conns, 1000), 100_000))
    cpu0 = cpu_seconds(t.pid) if t.pid else 0.0
    wall = run(many(t.port, f"/tput?n={events}", conns))
    cpu = (cpu_seconds(t.pid) - cpu0) if t.pid else 0.0
    total = conns * events
    return {"events_per_s": total / wall, "cpu_us_per_event": cpu / total * 1e6, "wall_s": wall}


def bench_latency(t: Target, streams: int, hz: float, secs: float) -> dict[str, float]:
    lat: list[int] = []
    cpu0 = cpu_seconds(t.pid) if t.pid else 0.0
    run(many(t.port, f"/rate?n={int(hz * secs)}&hz={hz}", streams, lat=lat))
    cpu = (cpu_seconds(t.pid) - cpu0) if t.pid else 0.0
    lat.sort()
    q = statistics.quantiles(lat, n=100)
    return {
        "p50_ms": q[49] / 1e6,
        "p99_ms": q[98] / 1e6,
        "events": len(lat),
        # one event per read here: the per-event cost without read coalescing
        "cpu_us_per_event": cpu / len(lat) * 1e6,
    }


def bench_park(t: Target, streams: int, secs: float) -> dict[str, float]:
    assert t.pid is not None
    gaps: list[float] = []
    rss0 = rss_bytes(t.pid)
    peak = rss0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_bytes(t.pid))  # type: ignore[arg-type]
            await asyncio.sleep(0.25)

    async def main() -> None:
        s = asyncio.ensure_future(sample())
        try:
            await many(t.port, f"/park?secs={secs}", streams, gaps=gaps)
        finally:
            s.cancel()

    run(main())
    return {
        "streams": len(gaps),
        "worst_gap_s": max(gaps),
        "rss_idle_mb": rss0 / 2**20,
        "rss_peak_mb": peak / 2**20,
    }


def start_baseline_sidecar(up: int, tree: Path) -> SidecarProcess:
    """The sidecar of another checkout, started with that checkout's interpreter and cwd.

    Given as flags: the options that checkout's table has; the loop and the log level
    also go by variable, which a checkout from before they were options reads.
    """
    cfg = ephemeral_config(f"http://127.0.0.1:{up}", upstream_max_idle=4096,
                           metrics_listen=None, log_level="WARNING")  # fmt: skip
    env = {"LLAMA_SIDECAR_UVLOOP": "0", "LLAMA_SIDECAR_LOG_LEVEL": "WARNING"}
    python = str(tree / ".venv" / "bin" / "python")
    known = subprocess.run(
        [python, "-c", "from sidecar.config import OPTIONS; print(*(o.name for o in OPTIONS))"],
        cwd=tree, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    exe, cwd = sys.executable, os.getcwd()
    sys.executable = python
    os.chdir(tree)  # `python -c` imports from its working directory first
    try:
        return start_subprocess(cfg, env=env, names=known)
    finally:
        sys.executable = exe
        os.chdir(cwd)


def start_sidecar(up: int, client: str, uvloop: bool) -> SidecarProcess:
    cfg = ephemeral_config(
        f"http://127.0.0.1:{up}",
        upstream_max_idle=4096,
        metrics_listen=None,
        log_level="WARNING",
        uvloop=uvloop,
    )
    return start_subprocess(cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-park", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pin", action="store_true", help="load on CPU 0, proxies on CPU 1")
    ap.add_argument("--targets", help="comma-separated target names to run")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--baseline", type=Path, help="another checkout: its sidecar as a target")
    args = ap.parse_args()
    # Commas inside brackets belong to a name: sidecar[h11,asyncio].
    names = re.split(r",(?![^\[]*\])", args.targets) if args.targets else None
    wanted = set(names) | {"direct"} if names else None
    conns, events = (20, 500) if args.quick else (50, 2000)
    lat_streams, lat_secs = (50, 2.0) if args.quick else (200, 5.0)
    park_streams, park_secs = (200, 3.0) if args.quick else (2000, 8.0)
    try:
        import uvloop  # noqa: F401

        have_uvloop = True
    except ImportError:
        have_uvloop = False

    up_proc, up = start_upstream()
    results: dict[str, dict[str, object]] = {}
    procs: list[SidecarProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        ngx = start_nginx(up, tmp)
        try:
            targets = [Target("direct", up, None)]
            if ngx:
                targets.append(Target("nginx", ngx[1], ngx[0].pid))
            variants = [("h11", True), ("h11", False)]
            for client, loop in variants:
                name = f"sidecar[{client},{'uvloop' if loop else 'asyncio'}]"
                if (loop and not have_uvloop) or (wanted is not None and name not in wanted):
                    continue
                sp = start_sidecar(up, client, loop)
                procs.append(sp)
                targets.append(Target(name, int(sp.url.rsplit(":", 1)[1]), sp.pid))
            if args.baseline is not None:
                sp = start_baseline_sidecar(up, args.baseline.resolve())
                procs.append(sp)
                port = int(sp.url.rsplit(":", 1)[1])
                targets.append(Target("sidecar[baseline]", port, sp.pid))
                if wanted is not None:
                    wanted.add("sidecar[baseline]")
            if wanted is not None:
                targets = [t for t in targets if t.name in wanted]
            if args.pin:
                # Load generator and fake upstream on CPU 0, the proxy under test on CPU 1.
                os.sched_setaffinity(0, {0})
                os.sched_setaffinity(up_proc.pid, {0})
                for t in targets:
                    if t.pid is not None:
                        os.sched_setaffinity(t.pid, {1})
            # Rounds interleave the targets so a burst of noise on this shared
            # machine hits all of them; the report takes the median per metric.
            runs: dict[str, list[dict[str, dict[str, float]]]] = {t.name: [] for t in targets}
            for rnd in range(args.rounds):
                for t in targets:
                    r = {"latency": bench_latency(t, lat_streams, 50.0, lat_secs)}
                    if not args.skip_throughput:
                        r["throughput"] = bench_throughput(t, conns, events)
                    runs[t.name].append(r)
                    print(rnd, t.name, json.dumps(r), flush=True)
            for name, rs in runs.items():
                results[name] = {
                    kind: {k: statistics.median(r[kind][k] for r in rs) for k in rs[0][kind]}
                    for kind in rs[0]
                }
            default = next((t for t in targets if t.name == "sidecar[h11,asyncio]"), None)
            if not args.skip_park and default is not None:
                results[default.name]["park"] = bench_park(default, park_streams, park_secs)
                print(default.name, "park", json.dumps(results[default.name]["park"]), flush=True)
        finally:
            for sp in procs:
                sp.terminate(5)
            if ngx:
                ngx[0].stop()
            up_proc.stop()
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


_NO_THROUGHPUT = {"events_per_s": float("nan"), "cpu_us_per_event": float("nan")}


def report(results: dict[str, dict[str, object]]) -> None:
    ngx = results.get("nginx", {}).get("throughput")
    direct = results["direct"]["latency"]
    print(
        "\n| target | events/s | CPU µs/event | CPU vs nginx | p50 ms | p99 ms"
        " | added p50 | added p99 | CPU µs/event at 50/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        tp, lt = r.get("throughput", _NO_THROUGHPUT), r["latency"]
        assert isinstance(tp, dict) and isinstance(lt, dict) and isinstance(direct, dict)
        ratio = (
            f"{tp['cpu_us_per_event'] / ngx['cpu_us_per_event']:.2f}x"  # type: ignore[index]
            if ngx and ngx["cpu_us_per_event"] and name != "direct"
            else "-"
        )
        cpu = f"{tp['cpu_us_per_event']:.2f}" if name != "direct" else "-"
        lat_cpu = f"{lt['cpu_us_per_event']:.1f}" if name != "direct" else "-"
        print(
            f"| {name} | {tp['events_per_s']:.0f} | {cpu} | {ratio} | {lt['p50_ms']:.3f} | "
            f"{lt['p99_ms']:.3f} | {lt['p50_ms'] - direct['p50_ms']:+.3f} | "
            f"{lt['p99_ms'] - direct['p99_ms']:+.3f} | "
            f"{lat_cpu} |"
        )
    for name, r in results.items():
        if "park" in r:
            print(f"\npark ({name}):", json.dumps(r["park"]))


if __name__ == "__main__":
    main()

"""`llama-sidecar up`: build, fetch the model, run llama-server and the sidecar, supervise."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from sidecar.cli.build import build_binary
from sidecar.cli.model import MODEL_HELP, describe_model, resolve_model, server_args_for
from sidecar.cli.options import config_from, with_table
from sidecar.ops.supervise import Supervisor, UpConfig, server_supports
from sidecar.paths import cache_dir


def has_page(server_url: str) -> bool:
    """Whether llama-server serves its web UI at / (a build with it, not started --no-webui)."""
    try:
        r = httpx.get(server_url + "/", headers={"Accept-Encoding": "gzip"}, timeout=10.0)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.headers.get("content-type", "").startswith("text/html")


def page_line(cfg: UpConfig, page: bool) -> str:
    """The banner's first line after "is up": where to chat, or why there is no page."""
    if page:
        return f"  open {cfg.sidecar_url}/ in a browser (the chat page)"
    return ("  no chat page: this llama-server has no web UI (built without node/npm, or "
            "--no-webui); the API below works")  # fmt: skip


def _ready_banner(cfg: UpConfig, preempt: bool, page: bool = False) -> str:
    model_name, template = describe_model(cfg.model, cfg.server_args)
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Say hello"}], "stream": True,
         "max_tokens": 64}
    )  # fmt: skip
    curl = (
        f"curl -N {cfg.sidecar_url}/v1/chat/completions "
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"
    )
    if cfg.sidecar.api_key:
        curl += " -H 'Authorization: Bearer $LLAMA_SIDECAR_API_KEY'"
    parking = (
        f"on ({'unlimited' if cfg.preempt_ram < 0 else f'{cfg.preempt_ram} MiB'} host RAM)"
        if preempt and cfg.preempt_ram != 0
        else "off"
    )
    return "\n".join(
        [
            "",
            "llama-sidecar is up",
            page_line(cfg, page),
            f"  API (through the sidecar): {cfg.sidecar_url}/v1/chat/completions",
            f"  llama-server (direct):     {cfg.server_url}   metrics: {cfg.server_url}/metrics",
            f"  sidecar metrics:           {cfg.metrics_url or 'off'}",
            f"  model: {model_name}",
            f"  chat template: {template}",
            f"  slots: {cfg.parallel}   context: {cfg.n_ctx} tokens (shared)   parking: {parking}",
            f"  llama-server log:          {cfg.server_log}",
            "try:",
            f"  {curl}",
            f"  llama-sidecar probe {cfg.sidecar_url} --streams {cfg.parallel + 1}",
            "Ctrl-C stops both.",
            "",
        ]
    )


def up(
    server_args: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="-- LLAMA_SERVER_ARGS",
            help="Extra arguments for llama-server, after `--` (they come last, so they win).",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", metavar="NAME|PATH", help=MODEL_HELP, show_default=False),
    ] = None,
    parallel: Annotated[
        int, typer.Option("--parallel", "-np", min=1, metavar="N", help="llama-server slots.")
    ] = 4,
    ctx_size: Annotated[
        int | None,
        typer.Option(
            "--ctx-size",
            "-c",
            metavar="N",
            help="Shared KV pool in tokens (default: 4096 per slot).",
        ),
    ] = None,
    preempt_ram: Annotated[
        int,
        typer.Option(
            metavar="MiB",
            help="MiB of host RAM for parked conversations (-1 unlimited, 0 = parking off).",
        ),
    ] = 4096,
    server_port: Annotated[
        int, typer.Option(metavar="PORT", help="llama-server port (always on loopback).")
    ] = 8080,
    ping_interval: Annotated[
        int,
        typer.Option(
            metavar="S", help="llama-server --sse-ping-interval in seconds (-1 disables pings)."
        ),
    ] = 1,
    server_bin: Annotated[
        Path | None,
        typer.Option(
            envvar="LLAMA_SERVER_BIN",
            metavar="PATH",
            help="Use this llama-server binary instead of building.",
        ),
    ] = None,
    cuda: Annotated[
        bool, typer.Option(help="Build llama-server with the CUDA backend (then pass -- -ngl 99).")
    ] = False,
    server_log: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="llama-server's log file (default: logs/llama-server-PORT.log in the cache).",
        ),
    ] = None,
    startup_timeout: Annotated[
        float, typer.Option(metavar="S", help="Seconds to wait for the model to load.")
    ] = 300.0,
    **sidecar_options: Any,
) -> None:
    """Run the patched llama-server (unified KV, N slots, parking on) with the sidecar in front.

    Builds llama-server if needed, makes sure the model is there, waits until both answer,
    prints the URLs, restarts llama-server if it dies, and stops both on Ctrl-C or SIGTERM.
    The sidecar takes every option of `llama-sidecar proxy` but the upstream (this server).
    """
    sidecar = config_from(sidecar_options, upstream=f"http://127.0.0.1:{server_port}")
    try:
        binary = server_bin or build_binary(cuda=cuda)
        if not binary.is_file():
            raise FileNotFoundError(f"no llama-server binary at {binary}")
        model_path = resolve_model(model)
    except ImportError as e:
        typer.echo(f"error: {e}; install the test extras: pip install -e '.[test]'", err=True)
        raise typer.Exit(1) from None
    except (ValueError, RuntimeError, subprocess.CalledProcessError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # Ctrl-C during the build or the model download
        typer.echo("[up] interrupted before start", err=True)
        raise typer.Exit(130) from None

    preempt = preempt_ram != 0 and server_supports(binary, "--preempt-ram")
    if preempt_ram != 0 and not preempt:
        typer.echo(
            f"[up] warning: {binary} has no --preempt-ram (a build without the preemption "
            "patch); conversations will fail when the KV pool fills instead of parking.",
            err=True,
        )
    cfg = UpConfig(
        server_bin=binary,
        model=model_path,
        sidecar=sidecar,
        server_port=server_port,
        parallel=parallel,
        ctx_size=ctx_size,
        preempt_ram=preempt_ram,
        ping_interval=ping_interval,
        startup_timeout=startup_timeout,
        server_log=server_log or cache_dir() / "logs" / f"llama-server-{server_port}.log",
        server_args=(*server_args_for(model_path), *(server_args or ())),
    )
    sup = Supervisor(cfg, preempt=preempt)

    def ready() -> None:
        typer.echo(_ready_banner(cfg, preempt, has_page(cfg.server_url)))
        sys.stdout.flush()

    rc = sup.run(on_ready=ready)
    if rc == 0:
        typer.echo("[up] stopped", err=True)
    raise typer.Exit(rc)


with_table(up, exclude=["upstream"])

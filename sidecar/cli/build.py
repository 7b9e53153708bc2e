"""`llama-sidecar build`: run build_llama.sh and print the binary path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from sidecar.paths import BUILD_SCRIPT


def build_binary(
    *,
    stock: bool = False,
    cuda: bool = False,
    native: bool = False,
    src: Path | None = None,
    quiet: bool = False,
) -> Path:
    """Build (or find in the cache) llama-server; return its path. Raises on failure."""
    if not BUILD_SCRIPT.exists():
        raise FileNotFoundError(
            f"{BUILD_SCRIPT} not found: `build` works from a checkout of llama-sidecar"
        )
    cmd = [str(BUILD_SCRIPT)]
    cmd += ["--stock"] * stock + ["--cuda"] * cuda + ["--native"] * native
    cmd += ["--quiet"] * quiet
    if src is not None:
        cmd += ["--src", str(src)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"build_llama.sh failed (exit {proc.returncode}); see the messages above"
        )
    return Path(proc.stdout.strip().splitlines()[-1])


def build(
    stock: Annotated[bool, typer.Option(help="Build without the patch series.")] = False,
    cuda: Annotated[bool, typer.Option(help="Build the CUDA backend.")] = False,
    native: Annotated[bool, typer.Option(help="Tune for this CPU (AMX: SIGILL).")] = False,
    src: Annotated[Path | None, typer.Option(help="A local llama.cpp checkout instead.")] = None,
) -> None:
    """Build the patched llama-server (cached: a second call is instant) and print its path."""
    try:
        path = build_binary(stock=stock, cuda=cuda, native=native, src=src)
    except (FileNotFoundError, RuntimeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(path))
    sys.stdout.flush()

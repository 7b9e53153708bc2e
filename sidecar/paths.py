"""Where things live: the checkout (build script, patches) and the cache outside it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "build_llama.sh"


def cache_dir() -> Path:
    """$LLAMA_SIDECAR_CACHE, else $XDG_CACHE_HOME/llama-sidecar, else ~/.cache/llama-sidecar."""
    env = os.environ.get("LLAMA_SIDECAR_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(xdg) / "llama-sidecar"


def models_dir() -> Path:
    return cache_dir() / "models"

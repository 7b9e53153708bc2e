"""build_llama.sh fails loudly and helpfully on a broken series or a bad download."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, cache_dir


def copy_checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    root.mkdir()
    shutil.copy2(REPO / "build_llama.sh", root)
    shutil.copytree(REPO / "server_patch", root / "server_patch")
    return root


def run(root: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(root / "build_llama.sh"), *args],
                          capture_output=True, text=True,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(cache.parent),
                               "LLAMA_SIDECAR_CACHE": str(cache)}, timeout=600)


@pytest.fixture
def shared_source_cache(tmp_path: Path, llama_server_bin: Path) -> Path:
    """A private cache that reuses the real cache's verified sdist and extracted source."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for sub in ("sdist", "src"):
        (cache / sub).symlink_to(cache_dir() / sub)
    return cache


def test_corrupted_patch_names_the_patch_and_hunk(tmp_path: Path,
                                                  shared_source_cache: Path) -> None:
    root = copy_checkout(tmp_path)
    first = next(p for p in (root / "server_patch").glob("0001-*.patch"))
    text = first.read_text()
    # Damage a context line of the first hunk: the hunk can no longer find its place.
    lines = text.splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if ln.startswith("@@"))
    j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith(" ") and lines[k].strip())
    lines[j] = " this context line is not in the source\n"
    for k in range(j + 1, len(lines)):
        if lines[k].startswith(" ") and lines[k].strip():
            lines[k] = " neither is this one\n"
    first.write_text("".join(lines))
    proc = run(root, shared_source_cache)
    assert proc.returncode != 0
    assert f"patch {first.name} does not apply" in proc.stderr
    assert "Hunk #1 FAILED" in proc.stderr
    assert "what to do:" in proc.stderr
    assert proc.stdout == ""


def test_series_naming_a_missing_patch(tmp_path: Path, shared_source_cache: Path) -> None:
    root = copy_checkout(tmp_path)
    with open(root / "server_patch" / "series", "a") as f:
        f.write("9999-does-not-exist.patch\n")
    proc = run(root, shared_source_cache)
    assert proc.returncode != 0
    assert "series names 9999-does-not-exist.patch" in proc.stderr


def test_sdist_with_wrong_checksum_is_rejected(tmp_path: Path) -> None:
    root = copy_checkout(tmp_path)
    cache = tmp_path / "cache"
    upstream = (root / "server_patch/upstream.env").read_text().splitlines()
    env = dict(ln.split("=", 1) for ln in upstream if "=" in ln and not ln.startswith("#"))
    bad = cache / "sdist" / env["SDIST_FILE"]
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not the sdist")
    proc = run(root, cache)
    assert proc.returncode != 0
    assert "sha256 mismatch" in proc.stderr
    assert not bad.exists(), "a corrupt download must be removed so the next run fetches it again"


def test_print_path_is_the_cached_binary(llama_server_bin: Path) -> None:
    proc = subprocess.run([str(REPO / "build_llama.sh"), "--print-path"],
                          capture_output=True, text=True)
    assert proc.returncode == 0
    assert Path(proc.stdout.strip()) == llama_server_bin
    assert llama_server_bin.is_file()


def test_unknown_option_is_an_error() -> None:
    proc = subprocess.run([str(REPO / "build_llama.sh"), "--bogus"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "unknown option: --bogus" in proc.stderr

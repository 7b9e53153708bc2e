"""The UI patch's own unit tests (Vitest, the UI's unit project) on this checkout's series.

The pinned tools/ui (from the extracted source build_llama.sh keeps in its cache) gets the
series' UI patches (those that change tools/ui only) in a temporary copy, which borrows the
node_modules that build_llama.sh installed from the same lock file. The tests cover the SSE
notice parser, the chat service's pause reports and the note a paused reply keeps, also against
what a lying or broken upstream sends; the pristine UI fails them (no parser, no onPause). They
run alone, in node, under a config of their own (vitest/vitest.config.ts here): the UI's config
sets up browser projects they do not use."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sidecar.paths import cache_dir
from tests.conftest import REPO

pytestmark = pytest.mark.slow

UI_TESTS = ["tests/unit/stream-notices.test.ts", "tests/unit/stream-notices-hostile.test.ts"]
CONFIG = Path(__file__).parent / "vitest"


def ui_patches() -> list[Path]:
    series = (REPO / "server_patch/series").read_text().splitlines()
    names = [ln.split("#")[0].strip() for ln in series if ln.split("#")[0].strip()]
    out = []
    for name in names:
        text = (REPO / "server_patch" / name).read_text()
        files = re.findall(r"^diff --git a/(\S+)", text, re.M)
        if files and all(f.startswith("tools/ui/") for f in files):
            out.append(REPO / "server_patch" / name)
    return out


def test_vitest_stream_notices(tmp_path: Path) -> None:
    if shutil.which("node") is None or shutil.which("npx") is None:
        pytest.skip("node/npm are not installed (apt-get install nodejs npm)")
    env = dict(ln.split("=", 1) for ln in (REPO / "server_patch/upstream.env").read_text()
               .splitlines() if "=" in ln and not ln.startswith("#"))  # fmt: skip
    sha = env["SDIST_SHA256"].strip().strip('"')
    pristine = cache_dir() / "src" / f"llama.cpp-{sha[:16]}"
    modules = cache_dir() / "ui" / "work" / "node_modules"
    if not (modules / ".bin" / "vitest").exists() or not (pristine / "tools/ui").is_dir():
        pytest.skip(f"the web UI has not been built in {cache_dir()} yet (./build_llama.sh)")
    patches = ui_patches()
    assert patches, "the series has no UI patch"
    root = tmp_path / "tree"
    shutil.copytree(pristine / "tools/ui", root / "tools/ui",
                    ignore=shutil.ignore_patterns("node_modules", "dist"))  # fmt: skip
    for p in patches:
        subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(p)], cwd=root,
                       check=True, capture_output=True)  # fmt: skip
    ui = root / "tools/ui"
    (ui / "node_modules").symlink_to(modules)
    for f in ("vitest.config.ts", "lucide-stub.ts"):  # the pinned UI has neither
        shutil.copy(CONFIG / f, ui / f)
    proc = subprocess.run(["npx", "vitest", "--run", "--config", "vitest.config.ts", *UI_TESTS],
                          cwd=ui, capture_output=True, text=True, timeout=600)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"Tests\s+\S*\s*\d+ passed", re.sub(r"\x1b\[[0-9;]*m", "", out)), out[-2000:]

"""build_llama.sh's web UI step on a stand-in (`--src`): the UI is built with npm once, its
output cached under the cache's ui/ (keyed by the UI's sources and lock file) and copied into
the tree's tools/ui/dist, where llama.cpp's CMake embeds it; a later build with the same
sources reuses it, a changed source rebuilds it without a second `npm ci`; no node/npm means
one line and a build without the page; a failing UI build names its log. The stand-in's
package has no dependencies, so `npm ci` needs no registry."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.tooling.test_build_progress import checkout, standin_tree

pytestmark = pytest.mark.skipif(
    not (shutil.which("cmake") and shutil.which("cc") and shutil.which("ccache")
         and shutil.which("node") and shutil.which("npm")),
    reason="needs cmake, a C compiler, ccache, node and npm (apt-get install nodejs npm)",
)  # fmt: skip

PACKAGE = {"name": "standin-ui", "version": "1.0.0", "private": True,
           "scripts": {"build": "node build.mjs"}}  # fmt: skip
LOCK = {"name": "standin-ui", "version": "1.0.0", "lockfileVersion": 3, "requires": True,
        "packages": {"": {"name": "standin-ui", "version": "1.0.0"}}}  # fmt: skip
# Writes the page into LLAMA_UI_OUT_DIR (as llama.cpp's svelte.config.js does) and counts its
# runs in STANDIN_UI_RUNS; STANDIN_UI_FAIL makes it fail the way a broken build does;
# STANDIN_MEET (a script, MEET below) first waits a while for the compile to be running too.
BUILD_MJS = """\
import fs from 'node:fs';
import { execFileSync } from 'node:child_process';
if (process.env.STANDIN_UI_FAIL) { console.error('vite: something broke'); process.exit(1); }
if (process.env.STANDIN_MEET) execFileSync('sh', [process.env.STANDIN_MEET, 'ui', 'compile']);
const out = process.env.LLAMA_UI_OUT_DIR;
fs.mkdirSync(out, { recursive: true });
fs.writeFileSync(out + '/index.html', fs.readFileSync('src/page.html'));
fs.appendFileSync(process.env.STANDIN_UI_RUNS, 'built\\n');
"""
UI_PATCH = """\
--- a/tools/ui/src/page.html
+++ b/tools/ui/src/page.html
@@ -1 +1 @@
-<p>chat</p>
+<p>chat, patched</p>
"""


# Two steps meet when each sees that the other has begun: `meet.sh ME OTHER` marks ME as begun,
# waits up to 30 s for OTHER, and records which it saw. Run one after the other, they do not.
MEET = """\
touch "$STANDIN_MEET_DIR/$1"
for _ in $(seq 150); do
    if [ -e "$STANDIN_MEET_DIR/$2" ]; then echo "$1 met $2" >> "$STANDIN_MEET_DIR/log"; exit 0; fi
    sleep 0.2
done
echo "$1 alone" >> "$STANDIN_MEET_DIR/log"
"""
# As in llama.cpp: a library llama-server links that does not need the page (its compile
# meets the UI's build), and llama-server's own target, which takes the page from
# tools/ui/dist at build time (ui-assets.cmake does, into ui.cpp).
LIKE_LLAMA_CPP = """
add_custom_command(OUTPUT sc.c COMMAND sh $ENV{STANDIN_MEET} compile ui
                   COMMAND ${CMAKE_COMMAND} -E copy ${CMAKE_SOURCE_DIR}/sc.c.in sc.c)
add_library(server-context STATIC sc.c)
add_custom_target(ui-assets COMMAND ${CMAKE_COMMAND} -E copy
    ${CMAKE_SOURCE_DIR}/tools/ui/dist/index.html ${CMAKE_BINARY_DIR}/embedded.html)
add_dependencies(llama-server ui-assets)
target_link_libraries(llama-server server-context)
"""


def with_ui(src: Path) -> Path:
    ui = src / "tools/ui"
    (ui / "src").mkdir(parents=True)
    (ui / "package.json").write_text(json.dumps(PACKAGE))
    (ui / "package-lock.json").write_text(json.dumps(LOCK))
    (ui / "build.mjs").write_text(BUILD_MJS)
    (ui / "src/page.html").write_text("<p>chat</p>\n")
    return src


def runs(tmp_path: Path) -> int:
    f = tmp_path / "runs"
    return len(f.read_text().splitlines()) if f.exists() else 0


def ui_build(co: Path, cache: Path, src: Path, tmp_path: Path, *flags: str,
             path: str = "/usr/local/bin:/usr/bin:/bin",
             **extra: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "HOME": str(cache.parent), "LLAMA_SIDECAR_CACHE": str(cache),
           "STANDIN_UI_RUNS": str(tmp_path / "runs"),
           "npm_config_cache": str(tmp_path / "npm-cache"), **extra}  # fmt: skip
    return subprocess.run([str(co / "build_llama.sh"), "--src", str(src), "--jobs", "2", *flags],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip


def tree_dist(cache: Path) -> list[Path]:
    return list((cache / "work").glob("*/src/tools/ui/dist/index.html"))


def test_the_ui_is_built_once_embedded_and_reused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    co, src = checkout(tmp_path), with_ui(standin_tree(tmp_path))
    first = ui_build(co, cache, src, tmp_path)
    assert first.returncode == 0, first.stderr
    assert runs(tmp_path) == 1
    lines = [ln for ln in first.stderr.splitlines() if "web UI" in ln]
    assert len(lines) == 2, first.stderr  # the one progress line, and its result
    assert "building the web UI from tools/ui" in lines[0]
    assert re.search(r"web UI built in \dm\d\ds", lines[1])
    log = (cache / "ui/build.log").read_text()
    assert "$ npm ci" in log
    assert "$ npm run build" in log
    # CMake finds the page where llama.cpp's ui-assets.cmake looks first.
    (page,) = tree_dist(cache)
    assert page.read_text() == "<p>chat</p>\n"
    info = (Path(first.stdout.strip()).parent / "BUILD-INFO").read_text()
    assert re.search(r"web UI: .*/ui/dist-[0-9a-f]{16}", info), info

    again = ui_build(co, cache, src, tmp_path)
    assert again.returncode == 0, again.stderr
    assert runs(tmp_path) == 1  # not built again
    assert "web UI: cached" in again.stderr
    assert "building the web UI" not in again.stderr
    assert tree_dist(cache)[0].read_text() == "<p>chat</p>\n"


def test_a_ui_patch_rebuilds_the_ui_without_reinstalling(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    co, src = checkout(tmp_path), with_ui(standin_tree(tmp_path))
    assert ui_build(co, cache, src, tmp_path).returncode == 0
    (co / "server_patch/0002-ui.patch").write_text(UI_PATCH)
    with open(co / "server_patch/series", "a") as f:
        f.write("0002-ui.patch\n")
    patched = ui_build(co, cache, src, tmp_path)
    assert patched.returncode == 0, patched.stderr
    assert runs(tmp_path) == 2
    log = (cache / "ui/build.log").read_text()
    assert "$ npm run build" in log
    assert "$ npm ci" not in log  # same lock file: node_modules kept
    assert tree_dist(cache)[0].read_text() == "<p>chat, patched</p>\n"
    # The patch out again: the first build's output is still cached.
    (co / "server_patch/series").write_text("0001-standin.patch\n")
    back = ui_build(co, cache, src, tmp_path)
    assert back.returncode == 0, back.stderr
    assert runs(tmp_path) == 2
    assert tree_dist(cache)[0].read_text() == "<p>chat</p>\n"


def test_without_node_one_line_and_a_build_without_the_page(tmp_path: Path) -> None:
    # A PATH with everything of /usr/bin but node and npm.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for entry in Path("/usr/bin").iterdir():
        if entry.name not in ("node", "nodejs", "npm", "npx"):
            (bin_dir / entry.name).symlink_to(entry)
    cache = tmp_path / "cache"
    co, src = checkout(tmp_path), with_ui(standin_tree(tmp_path))
    proc = ui_build(co, cache, src, tmp_path, path=str(bin_dir))
    assert proc.returncode == 0, proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if "node/npm" in ln]
    assert len(notes) == 1, proc.stderr
    assert "without its web UI" in notes[0]
    assert "the API works" in notes[0]
    assert runs(tmp_path) == 0
    assert tree_dist(cache) == []


def test_no_ui_and_stock_builds_leave_the_ui_out(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    co, src = checkout(tmp_path), with_ui(standin_tree(tmp_path))
    for flags in (("--no-ui",), ("--stock",)):
        proc = ui_build(co, cache, src, tmp_path, *flags)
        assert proc.returncode == 0, proc.stderr
        assert "web UI" not in proc.stderr
        assert "node/npm" not in proc.stderr
        assert tree_dist(cache) == []
    assert runs(tmp_path) == 0


def test_a_failing_ui_build_names_its_log_and_the_way_out(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    co, src = checkout(tmp_path), with_ui(standin_tree(tmp_path))
    proc = ui_build(co, cache, src, tmp_path, STANDIN_UI_FAIL="1")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "vite: something broke" in proc.stderr  # the log's tail
    assert "the web UI's build (npm run build) failed" in proc.stderr
    assert "--no-ui" in proc.stderr
    assert f"full log: {cache}/ui/build.log" in proc.stderr
    assert not list((cache / "ui").glob("dist-*"))  # nothing half-built is cached
    # Fixed, the next build makes it.
    ok = ui_build(co, cache, src, tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert runs(tmp_path) == 1


def like_llama_cpp(src: Path) -> None:
    with open(src / "CMakeLists.txt", "a") as f:
        f.write(LIKE_LLAMA_CPP)
    (src / "sc.c.in").write_text("int sc(void) { return 0; }\n")


def test_the_ui_builds_beside_the_compile_and_is_in_place_for_llama_server(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    co, src = checkout(tmp_path), with_ui(standin_tree(tmp_path))
    like_llama_cpp(src)
    (tmp_path / "meet.sh").write_text(MEET)
    (tmp_path / "meet").mkdir()
    proc = ui_build(co, cache, src, tmp_path, STANDIN_MEET=str(tmp_path / "meet.sh"),
                    STANDIN_MEET_DIR=str(tmp_path / "meet"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted((tmp_path / "meet/log").read_text().splitlines()) == [
        "compile met ui", "ui met compile"]  # fmt: skip
    assert "beside the compile" in proc.stderr
    assert re.search(r"web UI built in \dm\d\ds", proc.stderr), proc.stderr
    # llama-server's own step found the page in the tree.
    (embedded,) = (cache / "work").glob("*/build-patched/embedded.html")
    assert embedded.read_text() == "<p>chat</p>\n"


def test_a_ui_build_failing_beside_the_compile_stops_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    co, src = checkout(tmp_path), with_ui(standin_tree(tmp_path))
    like_llama_cpp(src)
    # The compile waits for a UI build that fails before it begins: alone, it would wait 30 s.
    (tmp_path / "meet.sh").write_text(MEET)
    (tmp_path / "meet").mkdir()
    proc = ui_build(co, cache, src, tmp_path, STANDIN_UI_FAIL="1",
                    STANDIN_MEET=str(tmp_path / "meet.sh"),
                    STANDIN_MEET_DIR=str(tmp_path / "meet"))  # fmt: skip
    assert proc.returncode == 1
    assert "the web UI's build (npm run build) failed" in proc.stderr
    assert "vite: something broke" in proc.stderr
    assert not (tmp_path / "meet/log").exists()  # stopped while it waited, not after
    assert not list((cache / "bin").glob("*/llama-server"))

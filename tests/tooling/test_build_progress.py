"""build_llama.sh on a small stand-in for llama.cpp (`--src`): one progress line instead of
the compiler's output, the full log kept in the cache, the errors and the log's tail on
failure, and a stock build that reuses (ccache) every object the patches do not touch. The
stand-in has what defeated that reuse in llama.cpp: an include directory inside the build
tree, and a unity build whose sources use __FILE__ (the generated unity sources #include
each file by its absolute path, which __FILE__ then puts into the preprocessed text)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (shutil.which("cmake") and shutil.which("cc") and shutil.which("ccache")),
    reason="needs cmake, a C compiler and ccache (apt-get install cmake build-essential ccache)",
)

CMAKELISTS = """\
cmake_minimum_required(VERSION 3.14)
# No compiler checks: every test configures a fresh build directory, and they are not its subject.
set(CMAKE_C_COMPILER_FORCED TRUE)
project(standin C)
option(GGML_CCACHE "" OFF)
if (GGML_CCACHE)
    set(CMAKE_C_COMPILER_LAUNCHER ccache)
endif()
# A generated header in the build tree, as llama.cpp has (its -I is an absolute build path).
configure_file(gen.h.in ${CMAKE_CURRENT_BINARY_DIR}/gen/gen.h)
add_library(base STATIC a.c b.c c.c)
target_include_directories(base PRIVATE ${CMAKE_CURRENT_BINARY_DIR}/gen)
add_library(unity STATIC u1.c u2.c u3.c u4.c)
set_target_properties(unity PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 2)
add_executable(llama-server tools/server/server-context.cpp.c)
target_link_libraries(llama-server base unity)
set_target_properties(llama-server PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
"""
SERVER = "int a(void); int b(void); int c(void);\nint main(void) { return a() + b() + c(); }\n"
PATCH = """\
--- a/tools/server/server-context.cpp.c
+++ b/tools/server/server-context.cpp.c
@@ -1,2 +1,2 @@
 int a(void); int b(void); int c(void);
-int main(void) { return a() + b() + c(); }
+int main(void) { return a() + b() + c() - 6; }
"""


# A first step that prints nothing for a while, as a cold build's first compiles do. It runs on
# every build (a target without outputs), so only the progress line's test has it.
QUIET_START = """
add_custom_target(quiet_start COMMAND sleep 2.5)
add_dependencies(base quiet_start)
add_dependencies(unity quiet_start)
"""


def standin_tree(root: Path, server: str = SERVER, quiet_start: bool = False) -> Path:
    src = root / "llama.cpp"
    (src / "tools/server").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(CMAKELISTS + (QUIET_START if quiet_start else ""))
    (src / "gen.h.in").write_text("#define GEN 1\n")
    for name in "abc":
        (src / f"{name}.c").write_text(f'#include "gen.h"\nint {name}(void) {{ return GEN; }}\n')
    for i in range(1, 5):  # __FILE__, as in GGML_ASSERT: the path is in the preprocessed text
        (src / f"u{i}.c").write_text(f"int u{i}(void) {{ return {i}; }}\n"
                                     f"const char *u{i}_file(void) {{ return __FILE__; }}\n")
    (src / "tools/server/server-context.cpp").write_text("// marks a llama.cpp tree\n")
    (src / "tools/server/server-context.cpp.c").write_text(server)
    return src


def checkout(root: Path) -> Path:
    co = root / "checkout"
    (co / "server_patch").mkdir(parents=True)
    shutil.copy2(REPO / "build_llama.sh", co)
    shutil.copy2(REPO / "server_patch/upstream.env", co / "server_patch")
    (co / "server_patch/series").write_text("0001-standin.patch\n")
    (co / "server_patch/0001-standin.patch").write_text(PATCH)
    return co


def build(co: Path, cache: Path, src: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(cache.parent),
           "LLAMA_SIDECAR_CACHE": str(cache)}  # fmt: skip
    return subprocess.run([str(co / "build_llama.sh"), "--src", str(src), "--jobs", "2", *flags],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip


def reused(stderr: str) -> tuple[int, int]:
    m = re.search(r"ccache reused (\d+) of (\d+) compiles", stderr)
    assert m, stderr
    return int(m.group(1)), int(m.group(2))


def test_one_progress_line_and_the_full_log_in_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    proc = build(checkout(tmp_path), cache, standin_tree(tmp_path, quiet_start=True))
    assert proc.returncode == 0, proc.stderr
    binary = Path(proc.stdout.strip())
    assert binary.is_file()
    assert binary.parent.parent == cache / "bin"
    assert "Building C object" not in proc.stderr  # no compiler lines on the terminal
    # The progress line, printed although the log had no percentage at the first look. Its
    # elapsed time is not asserted: on a loaded machine the first line came 26 s in.
    assert re.search(r"compiling patched llama-server: +\d+%  \d+m\d\ds elapsed", proc.stderr), (
        proc.stderr
    )
    assert re.search(r"compiled in \dm\d\ds", proc.stderr), proc.stderr
    assert "Building C object" in (binary.parent / "build.log").read_text()
    logs = list((cache / "work").glob("*/build-patched.log"))
    assert len(logs) == 1
    assert "Linking C executable bin/llama-server" in logs[0].read_text()


def test_failure_shows_the_error_and_the_log_tail(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    src = standin_tree(tmp_path, SERVER.replace("return", "retrun"))
    proc = build(checkout(tmp_path), cache, src, "--stock")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "---- first errors ----" in proc.stderr
    assert "retrun" in proc.stderr  # the compiler's own message, with the offending line
    assert "---- last lines of" in proc.stderr
    m = re.search(r"full log: (\S+)\)", proc.stderr)
    assert m
    assert "retrun" in Path(m.group(1)).read_text()


def test_stock_after_patched_reuses_every_untouched_object(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    co, src = checkout(tmp_path), standin_tree(tmp_path)
    patched = build(co, cache, src)
    assert patched.returncode == 0, patched.stderr
    assert reused(patched.stderr) == (0, 6)
    stock = build(co, cache, src, "--stock")
    assert stock.returncode == 0, stock.stderr
    # a.c, b.c, c.c (-I into the build tree) and both unity sources are reused; only the
    # patched file is compiled again.
    assert reused(stock.stderr) == (5, 6)
    assert subprocess.run([stock.stdout.strip()]).returncode == 3
    assert subprocess.run([patched.stdout.strip()]).returncode == 3 - 6 + 256


def test_a_patch_dropped_from_the_series_is_dropped_from_the_binary(tmp_path: Path) -> None:
    """The dropped patch's file is back to its pristine text and its older mtime: the
    objects made from the patched text must not survive (make alone would keep them)."""
    cache = tmp_path / "cache"
    co, src = checkout(tmp_path), standin_tree(tmp_path)
    patched = build(co, cache, src)
    assert patched.returncode == 0, patched.stderr
    assert subprocess.run([patched.stdout.strip()]).returncode == 3 - 6 + 256
    (co / "server_patch/series").write_text("# no patches\n")
    rebuilt = build(co, cache, src)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert subprocess.run([rebuilt.stdout.strip()]).returncode == 3


def test_a_src_given_through_a_link_is_copied_and_left_as_it_is(tmp_path: Path) -> None:
    """`--src LINK`: the tree the link points to is copied and patched, never changed. (Taken as
    a logical path, the link itself was copied: the copy's `.git` was removed, and the series
    applied, through it, in the edit tree it pointed to.)"""
    src = standin_tree(tmp_path)
    (src / ".git").mkdir()
    (src / ".git/HEAD").write_text("ref: refs/heads/main\n")
    link = tmp_path / "edit-tree"
    link.symlink_to(src, target_is_directory=True)
    proc = build(checkout(tmp_path), tmp_path / "cache", link)
    assert proc.returncode == 0, proc.stderr
    assert subprocess.run([proc.stdout.strip()]).returncode == 3 - 6 + 256  # patched
    assert (src / ".git/HEAD").read_text() == "ref: refs/heads/main\n"
    assert (src / "tools/server/server-context.cpp.c").read_text() == SERVER

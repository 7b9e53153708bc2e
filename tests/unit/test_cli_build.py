"""The one helper that runs build_llama.sh and takes the binary's path (the CLI, the test
fixtures and the benchmarks all call it), on a stand-in script."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.cli.build import BIN_ENV, STOCK_BIN_ENV, build_binary, server_binary


def stand_in(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "build_llama.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return script


def test_the_path_is_the_last_line_and_the_flags_are_passed(tmp_path: Path) -> None:
    script = stand_in(tmp_path, 'echo "progress" >&2\necho "some line"\necho "/bin/$*"\n')
    got = build_binary(stock=True, print_path=True, src=Path("/src"), script=script)
    assert got == Path("/bin/--stock --print-path --src /src")


def test_a_failing_build_names_the_script_the_flags_and_the_exit(tmp_path: Path) -> None:
    script = stand_in(tmp_path, 'echo "patch 3 does not apply" >&2\nexit 3\n')
    with pytest.raises(RuntimeError, match=r"build_llama.sh --stock failed \(exit 3\)") as e:
        build_binary(stock=True, capture_stderr=True, script=script)
    assert "patch 3 does not apply" in str(e.value)


def test_a_build_that_prints_no_path_fails(tmp_path: Path) -> None:
    script = stand_in(tmp_path, "exit 0\n")
    with pytest.raises(RuntimeError, match="no path printed"):
        build_binary(script=script)


def test_a_missing_script_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="works from a checkout"):
        build_binary(script=tmp_path / "build_llama.sh")


def test_the_environment_overrides_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BIN_ENV, "/opt/patched/llama-server")
    monkeypatch.setenv(STOCK_BIN_ENV, "/opt/stock/llama-server")
    assert server_binary() == Path("/opt/patched/llama-server")
    assert server_binary(stock=True) == Path("/opt/stock/llama-server")

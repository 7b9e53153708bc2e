"""The sidecar announces itself once: one "listening on" line across stdout and stderr
(`up` shows both, and used to show the line twice: a print and a log record)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def test_the_startup_line_is_printed_once() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from sidecar.cli.proxy import main; main()",
         "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "listening on http://127.0.0.1:" in first, first
    # The CLI prints the line before it installs its signal handlers: give it a moment, so
    # that SIGTERM drains (at once: nothing runs) rather than kills.
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(20) == 0, rest
    proc.stdout.close()
    lines = [ln for ln in (first + rest).splitlines() if "listening on" in ln]
    assert lines == [first.rstrip("\n")], lines

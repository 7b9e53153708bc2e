"""The sidecar announces itself once: one "listening on" line across stdout and stderr
(`up` shows both, and used to show the line twice: a print and a log record), and only
once it takes SIGTERM as a drain: a supervisor may signal as soon as it reads the line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ARGS = ["--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0",
        "--metrics-listen", "127.0.0.1:0"]  # fmt: skip

# The child sends itself SIGTERM from inside the write of the "listening" line: the
# earliest moment anyone who reads the line can signal.
_SIGNAL_ON_THE_LINE = """
import os, signal, sys

class SignalOnTheLine:
    def __init__(self, out):
        self.out = out

    def write(self, text):
        n = self.out.write(text)
        if "listening on" in text:
            self.out.flush()
            os.kill(os.getpid(), signal.SIGTERM)
        return n

    def __getattr__(self, name):
        return getattr(self.out, name)

sys.stdout = SignalOnTheLine(sys.stdout)
from sidecar.cli.proxy import main
main()
"""


def _start(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *ARGS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def test_the_startup_line_is_printed_once() -> None:
    proc = _start("from sidecar.cli.proxy import main; main()")
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "listening on http://127.0.0.1:" in first, first
    proc.send_signal(signal.SIGTERM)  # at once: the handlers are in before the line
    rest = proc.stdout.read()
    assert proc.wait(20) == 0, rest
    proc.stdout.close()
    lines = [ln for ln in (first + rest).splitlines() if "listening on" in ln]
    assert lines == [first.rstrip("\n")], lines


def test_sigterm_sent_on_the_listening_line_drains_rather_than_kills() -> None:
    """The line used to be printed before the signal handlers were installed: a SIGTERM
    in between killed the process (exit -15) instead of draining it (exit 0)."""
    proc = _start(_SIGNAL_ON_THE_LINE)
    out, _ = proc.communicate(timeout=20)
    assert "listening on http://127.0.0.1:" in out, out
    assert proc.returncode == 0, (proc.returncode, out)

"""`--help` of the program and of every command answers, and names the key options."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from sidecar.cli import app

runner = CliRunner()

COMMANDS = {
    "build": ["--stock", "--cuda"],
    "model": ["[NAME|PATH]"],
    "proxy": ["--upstream", "--listen", "--metrics-listen", "--park-keepalive"],
    "up": [
        "--model",
        "--parallel",
        "--preempt-ram",
        "--server-bin",
        "--cuda",
        "LLAMA_SERVER_ARGS",
    ],
    "probe": ["--streams", "--prompt", "--max-tokens", "--json", "--plot"],
}
# Generated test models are a fixture (tests/support/tinymodel.py), not a user feature.
GONE = {"model": ["--tiny", "--slow"], "up": ["--tiny"]}


def test_top_level_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    for name in COMMANDS:
        assert name in result.output


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_help(command: str) -> None:
    result = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for option in COMMANDS[command]:
        assert option in result.output, f"{command} --help does not mention {option}"
    for option in GONE.get(command, []):
        assert option not in result.output, f"{command} --help still offers {option}"

"""`llama-sidecar`: build the patched server, fetch a model, run and probe the stack.

One module per command; each parses its options and calls one function.
"""

from __future__ import annotations

import typer

from sidecar.cli import build, model, probe, proxy, up

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Patched llama-server that parks conversations instead of failing them, "
    "and a keepalive-aware proxy in front of it.",
)
app.command()(build.build)
app.command()(model.model)
app.command()(proxy.proxy)
app.command()(up.up)
app.command()(probe.probe)


def main() -> None:
    app()

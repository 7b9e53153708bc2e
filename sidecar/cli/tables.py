"""The docs' option tables, generated from the table (:data:`sidecar.config.OPTIONS`).

In a doc, a generated table sits between ``<!-- options: NAME -->`` and
``<!-- /options -->``: ``sidecar`` is every option of the table (flag, variable,
default, meaning), a command's name (``up``) its own options, read from the command
itself.  ``python -m sidecar.cli.tables --write`` regenerates every one; ``--check``
exits 1 when one differs, as ``tests/unit/test_option_tables.py`` does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import typer.main

from sidecar.config import OPTIONS, Option

__all__ = ["DOCS", "command_table", "default_text", "regions", "render", "sidecar_table"]

REPO = Path(__file__).resolve().parents[2]
# The docs that hold generated tables, relative to the repository.
DOCS = ("README.md", "docs/sidecar.md", "docs/operations.md")
_REGION = re.compile(r"(<!-- options: (\S+) -->\n)(.*?)(<!-- /options -->)", re.S)
KiB = 1024


def default_text(o: Option) -> str:
    """The default as the docs and ``--help`` show it."""
    if o.default is None:
        return "off"
    if o.type is bool:
        return o.format(o.default)
    if o.metavar == "BYTES" and o.default >= KiB:
        for unit, size in (("MiB", KiB * KiB), ("KiB", KiB)):
            if o.default % size == 0:
                return f"{o.default // size} {unit}"
    if o.type is float and float(o.default).is_integer():
        return str(int(o.default))
    return o.format(o.default) or '""'


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return _cell(f"`{text}`")


def sidecar_table() -> str:
    """Every option: flag, variable, default, meaning."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for o in OPTIONS:
        default = default_text(o)
        shown = _code(default) if o.type is str and o.default is not None else default
        rows.append(f"| {_code(f'{o.flag} {o.metavar}')} | {_code(o.env)} | {shown} | "
                    f"{_cell(o.help)} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def command_table(command: str) -> str:
    """A command's own options (not the table's): option, default, meaning."""
    from sidecar.cli import app

    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    table = {o.flag for o in OPTIONS}
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for p in cmd.params:
        if p.param_type_name == "argument":
            rows.append(f"| {_code(p.metavar)} | | {_cell(getattr(p, 'help', '') or '')} |")
            continue
        if p.opts[0] in table or p.hidden:
            continue
        flags = "/".join(p.opts + p.secondary_opts)
        if not p.is_flag:
            assert p.metavar, f"{command} {p.opts[0]}: give it a metavar (the docs show it)"
            flags += f" {p.metavar}"
        cell = _code(flags)
        if p.envvar:
            cell += f" / {_code(str(p.envvar))}"
        if p.is_flag:
            default = "on" if p.default else "off"
        elif p.default is None:
            default = ""
        elif isinstance(p.default, float) and p.default.is_integer():
            default = str(int(p.default))
        else:
            default = str(p.default)
        rows.append(f"| {cell} | {_cell(default)} | {_cell(p.help or '')} |")
    return "\n".join(rows) + "\n"


def render(name: str) -> str:
    """The table a doc's ``<!-- options: NAME -->`` region holds."""
    return sidecar_table() if name == "sidecar" else command_table(name)


def regions(text: str) -> list[tuple[str, str]]:
    """The generated regions of a doc: (name, content)."""
    return [(m.group(2), m.group(3)) for m in _REGION.finditer(text)]


def rewrite(text: str) -> str:
    return _REGION.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    """``--write``: regenerate the docs' tables; ``--check``: exit 1 if one differs."""
    args = sys.argv[1:] if argv is None else argv
    if args not in (["--write"], ["--check"]):
        print("usage: python -m sidecar.cli.options --write | --check", file=sys.stderr)
        return 2
    stale = []
    for doc in DOCS:
        path = REPO / doc
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            stale.append(doc)
            if args == ["--write"]:
                path.write_text(new)
    if args == ["--check"] and stale:
        print(f"option tables differ from sidecar/config.py: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The docs' option tables are the table in sidecar/config.py (generated, or checked)."""

from __future__ import annotations

import re

import pytest

from sidecar.cli.tables import DOCS, REPO, default_text, regions, render, rewrite
from sidecar.config import ENV_PREFIX, OPTION_BY_NAME, OPTIONS

ALL_DOCS = sorted({*DOCS, *(p.relative_to(REPO).as_posix() for p in REPO.glob("docs/*.md"))})
_PIPE = re.compile(r"(?<!\\)\|")


@pytest.mark.parametrize("doc", DOCS)
def test_every_generated_table_is_the_code(doc: str) -> None:
    text = (REPO / doc).read_text()
    found = regions(text)
    assert found, f"{doc} has no generated option table"
    for name, content in found:
        assert content == render(name), (
            f"{doc}: the '{name}' options table differs from the code; "
            "run python -m sidecar.cli.tables --write"
        )


def test_the_sidecar_table_is_in_the_docs_with_every_option() -> None:
    table = render("sidecar")
    for o in OPTIONS:
        assert f"`{o.env}`" in table, o.name
    assert "--ready-min-free-kv" in table
    assert any(name == "sidecar" for doc in DOCS for name, _ in regions((REPO / doc).read_text()))


def test_a_changed_row_is_found() -> None:
    text = (REPO / "docs/sidecar.md").read_text()
    assert rewrite(text) == text
    changed = text.replace(
        "| `LLAMA_SIDECAR_DRAIN_TIMEOUT` | 30 |", "| `LLAMA_SIDECAR_DRAIN_TIMEOUT` | 10 |"
    )
    assert changed != text
    assert rewrite(changed) != changed


def _rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in _PIPE.split(line.strip())[1:-1]]
        for line in text.splitlines()
        if line.lstrip().startswith("|")
    ]


@pytest.mark.parametrize("doc", ALL_DOCS)
def test_a_written_row_that_names_an_option_agrees_with_the_table(doc: str) -> None:
    """Any table row with an option's variable: its flag before it, its default after."""
    text = (REPO / doc).read_text()
    for row in _rows(text):
        for i, cell in enumerate(row):
            m = re.fullmatch(rf"`{ENV_PREFIX}([A-Z_]+)`", cell)
            if m is None or m.group(1).lower() not in OPTION_BY_NAME:
                continue
            o = OPTION_BY_NAME[m.group(1).lower()]
            assert i > 0, (doc, row)
            assert row[i - 1].startswith(f"`{o.flag}"), (doc, row)
            default = row[i + 1].strip("`").removesuffix(" s")
            assert default == default_text(o), (doc, row)

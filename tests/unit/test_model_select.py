"""Model selection: named models, paths, the GGUF header reader, and what `up` says about
the chat template."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

from sidecar.cli import app
from sidecar.cli.model import (
    DEFAULT_MODEL,
    GEMMA_SERVER_ARGS,
    MODELS,
    describe_model,
    resolve_model,
)
from sidecar.ops.gguf_meta import GGUFError, chat_template, read_metadata
from tests.support.tinymodel import ensure_model

TEMPLATE = "{% for m in messages %}<|user|>{{ m.content }}{% endfor %}<|assistant|>"


def write_header_only(path: Path, template: str | None) -> Path:
    """A GGUF with metadata (and a string array, which the reader must skip) but no tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("header only")
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "bb"])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0])
    if template is not None:
        w.add_chat_template(template)
    w.add_uint32("test.after_the_arrays", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_default_is_a_chat_model_and_gemma_stays_reachable() -> None:
    assert DEFAULT_MODEL == "smollm2"
    assert "Instruct" in MODELS[DEFAULT_MODEL].summary
    assert "chat" in MODELS[DEFAULT_MODEL].summary
    assert MODELS["gemma"].server_args == GEMMA_SERVER_ARGS


def test_a_path_is_used_as_given_and_a_bad_name_lists_the_names(tmp_path: Path) -> None:
    f = write_header_only(tmp_path / "m.gguf", None)
    assert resolve_model(str(f)) == f
    assert resolve_model(f) == f
    with pytest.raises(FileNotFoundError, match="smollm2, gemma"):
        resolve_model("no-such-model")


def test_header_reader_finds_the_template_after_arrays(tmp_path: Path) -> None:
    meta = read_metadata(write_header_only(tmp_path / "t.gguf", TEMPLATE))
    assert chat_template(meta) == TEMPLATE
    assert meta["general.name"] == "header only"
    assert meta["test.after_the_arrays"] == 7  # the token arrays were skipped correctly
    assert chat_template(read_metadata(write_header_only(tmp_path / "n.gguf", None))) is None


def test_header_reader_rejects_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(GGUFError, match="not a GGUF"):
        read_metadata(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(write_header_only(tmp_path / "c.gguf", TEMPLATE).read_bytes()[:40])
    with pytest.raises(GGUFError, match="ends inside"):
        read_metadata(cut)


def test_describe_model_says_whether_there_is_a_chat_template(tmp_path: Path) -> None:
    with_t = write_header_only(tmp_path / "with.gguf", TEMPLATE)
    without = write_header_only(tmp_path / "without.gguf", None)
    name, template = describe_model(with_t)
    assert name == "with.gguf (header only)"
    assert template.startswith("yes")
    _, template = describe_model(without)
    assert template.startswith("none")
    assert "--chat-template" in template
    _, template = describe_model(without, ("-t", "1", "--chat-template", "gemma"))
    assert template == "gemma (set by --chat-template)"
    # The generated test models carry no template either.
    _, template = describe_model(ensure_model(tmp_path, "tiny"))
    assert template.startswith("none")


def test_up_help_lists_the_named_models() -> None:
    result = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    for name in MODELS:
        assert name in result.output
    assert "smollm2 (default)" in result.output
    result = CliRunner().invoke(app, ["model", "--help"], terminal_width=300)
    assert "smollm2" in result.output
    assert "gemma" in result.output

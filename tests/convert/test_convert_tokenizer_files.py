"""Reading tokenizer.json / tokenizer_config.json / generation_config.json / chat_template.jinja."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from colibri_format.convert import tokenizer_files
from colibri_format.convert.tokenizer_files import read_tokenizer
from colibri_format.errors import InvalidInput


def save_tiny_tokenizer(folder: Path) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    text = tok.to_str()
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    return text


def test_reads_all_three_files_verbatim(tmp_path: Path) -> None:
    text = save_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}", "eos_token": "w"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = read_tokenizer(tmp_path)
    assert tok == {"tokenizer_json": text, "tokenizer_config": {"chat_template": "{{ x }}", "eos_token": "w"},
                   "generation_config": {"eos_token_id": 2}}


def test_jinja_template_is_folded_in_only_when_the_config_has_none(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert read_tokenizer(tmp_path)["tokenizer_config"] == {"chat_template": "{{ messages }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "mine"}))
    assert read_tokenizer(tmp_path)["tokenizer_config"]["chat_template"] == "mine"


def test_no_tokenizer_json_means_none(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert read_tokenizer(tmp_path) is None


@pytest.mark.parametrize("name, data, needle", [
    ("tokenizer.json", b"[]", "object"), ("tokenizer.json", b"\xff", "UTF-8"),
    ("tokenizer_config.json", b'{"a": 1, "a": 2}', "duplicate"), ("generation_config.json", b"3", "object"),
])
def test_bad_files_are_invalid_input(tmp_path: Path, name: str, data: bytes, needle: str) -> None:
    save_tiny_tokenizer(tmp_path)
    (tmp_path / name).write_bytes(data)
    with pytest.raises(InvalidInput, match=needle):
        read_tokenizer(tmp_path)


def test_caps_and_symlink_escape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_tiny_tokenizer(tmp_path)
    monkeypatch.setattr(tokenizer_files, "TOKENIZER_JSON_MAX_BYTES", 10)
    with pytest.raises(InvalidInput, match="cap"):
        read_tokenizer(tmp_path)
    monkeypatch.undo()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(tmp_path / "tokenizer.json", ckpt / "tokenizer.json")
    with pytest.raises(InvalidInput, match="outside"):
        read_tokenizer(ckpt)

"""The embedded tokenizer: text round trip, stop ids, chat templates (jinja2 optional), engine text I/O."""

from __future__ import annotations

import sys

import pytest

from colibri_format.errors import InvalidInput, InvalidMetadata
from colibri_format.runtime import Engine
from colibri_format.runtime.tokenizer import Tokenizer
from tests.runtime.numpy_tiny import WORDS, random_weights, tokenizer_entry
from tests.runtime.tiny_weights import write_colibri


def test_round_trip_and_stop_ids():
    tok = Tokenizer.from_metadata({"tokenizer": tokenizer_entry()})
    ids = tok.encode("hello world")
    assert ids == [3, 4] and tok.decode(ids) == "hello world"
    assert tok.decode([1, 3, 2]) == "hello"             # special tokens skipped
    assert tok.stop_ids == [2]                           # from the eos token when generation_config has none
    both = Tokenizer.from_metadata({"tokenizer": tokenizer_entry(generation_config={"eos_token_id": [2, 9]})})
    assert both.stop_ids == [2, 9]


def test_no_tokenizer_and_a_broken_one():
    assert Tokenizer.from_metadata({"tokenizer": None}) is None
    with pytest.raises(InvalidMetadata, match="tokenizer_json"):
        Tokenizer("{not json", {}, {})


def test_chat_template_renders_and_encodes():
    tok = Tokenizer.from_metadata({"tokenizer": tokenizer_entry()})
    messages = [{"role": "user", "content": "hi there"}]
    assert tok.apply_chat_template(messages) == "<s>user : hi there </s> assistant :"
    assert tok.encode_chat(messages) == [1, 5, 7, 8, 9, 2, 6, 7]


def test_chat_needs_a_template_and_jinja2(monkeypatch):
    plain = Tokenizer.from_metadata({"tokenizer": tokenizer_entry(tokenizer_config={})})
    with pytest.raises(InvalidInput, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    tok = Tokenizer.from_metadata({"tokenizer": tokenizer_entry()})
    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    with pytest.raises(ImportError, match="pip install jinja2"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_engine_text_prompt_and_default_stop(tmp_path):
    weights = random_weights(vocab_size=len(WORDS))
    weights.metadata = {"tokenizer": tokenizer_entry()}
    with Engine(write_colibri(weights, tmp_path / "words.colibri")) as eng:
        out = eng.generate("hello world", max_new_tokens=6)
        assert out.output_ids == eng.generate([3, 4], max_new_tokens=6).output_ids
        assert out.text == eng.tokenizer.decode(out.output_ids)
        assert 2 not in out.output_ids[:-1]              # </s> ends generation by default

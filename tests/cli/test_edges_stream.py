"""Streamed text end to end: `colibri infer` on a model whose greedy output is a chain of token ids the test chose,
embedding a byte-level BPE tokenizer (built with `tokenizers`) whose tokens split multi-byte characters. What
streams to standard output is exactly the final decode that `--json` reports: for CJK, accents, 4-byte emoji,
outputs that end in the middle of a character, and outputs cut by --stop.

(It used to print `="` and drop the rest after a character split across tokens, with exit 0.)
"""

from __future__ import annotations

import json

import pytest

from tests.cli.byte_bpe import byte_level_bpe, chain, splits_a_character, write_chain_model
from tests.cli.test_edges import colibri, lines

pytestmark = pytest.mark.timeout(300)

START = ord("x")          # the prompt: one token, "x"


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


def _model(tmp_path, tok, text: str) -> tuple[str, list[int]]:
    ids = tok.encode(text).ids
    assert splits_a_character(tok, ids)
    return write_chain_model(tmp_path / "chain.colibri", tok, chain(ids, START)), ids


def _streamed_and_final(path: str, n: int, *extra: str) -> tuple[str, dict]:
    args = ("infer", path, "--ids", str(START), "--max-new-tokens", str(n), *extra)
    streamed, as_json = colibri(*args), colibri(*args, "--json")
    assert streamed.returncode == 0 and streamed.stderr == b"", lines(streamed.stderr)
    assert as_json.returncode == 0, lines(as_json.stderr)
    return streamed.stdout.decode("utf-8"), json.loads(as_json.stdout)


# each text's tokens are distinct, so the chain repeats the text exactly
@pytest.mark.parametrize("text", ['="€"', "中文字", "café ", "😀𝄞", "🎉", 'a="€"中é😀'])
def test_streamed_text_is_the_final_decode(tmp_path, tok, text):
    path, ids = _model(tmp_path, tok, text)
    out, result = _streamed_and_final(path, 3 * len(ids))
    assert result["output_ids"] == (ids * 3) and result["text"] == text * 3       # the chain, three times
    assert out == result["text"] + "\n"


def test_an_output_ending_mid_character(tmp_path, tok):
    path, ids = _model(tmp_path, tok, "中文字😀")
    cut = next(k for k in range(len(ids), 0, -1) if tok.decode(ids[:k]).endswith("\ufffd"))
    out, result = _streamed_and_final(path, cut)
    assert result["text"].endswith("\ufffd") and out == result["text"] + "\n"


@pytest.mark.parametrize("stop", ["€", "中é"])
def test_an_output_cut_by_a_stop_string(tmp_path, tok, stop):
    path, ids = _model(tmp_path, tok, 'a="€"中é😀')
    out, result = _streamed_and_final(path, 2 * len(ids), "--stop", stop)
    assert result["finish_reason"] == "stop" and stop not in out
    assert out == result["text"] + "\n" and result["text"] == 'a="€"中é😀'.split(stop)[0]

"""The `make demo` job on the bundled model, step by step through the CLI (convert, inspect, validate,
infer with the embedded tokenizer and chat template)."""

import json
from pathlib import Path

import pytest

from colibri_format.cli import main

MODEL = Path(__file__).resolve().parent.parent / "models" / "colibri-demo-moe"


@pytest.fixture(scope="module")
def demo_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo.colibri"
    assert main(["convert", "--model-path", str(MODEL), "--output-path", str(out), "--quiet"]) == 0
    return out


def test_inspect_and_validate(demo_file, capsys):
    assert main(["inspect", str(demo_file), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["metadata"]["architecture"] == "qwen3_moe"
    assert info["metadata"]["tokenizer"] == {"embedded": True, "bytes": info["metadata"]["tokenizer"]["bytes"],
                                             "chat_template": True}   # from chat_template.jinja
    assert len(info["experts"]["entries"]) == 6 * 8
    assert main(["validate", str(demo_file)]) == 0


def test_infer_text_and_chat(demo_file, capsys):
    assert main(["infer", str(demo_file), "--prompt", "import os\n", "--max-new-tokens", "8", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert len(plain["output_ids"]) == 8 and isinstance(plain["text"], str) and plain["text"]
    assert main(["infer", str(demo_file), "--prompt", "hello", "--chat", "--max-new-tokens", "4", "--json"]) == 0
    chat = json.loads(capsys.readouterr().out)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    prompt = tok.decode(chat["prompt_ids"], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"), prompt


def test_the_demo_converts_again_over_its_own_output(tmp_path, monkeypatch):
    """`make demo` twice: the second convert replaces the first one's file instead of refusing it."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    import demo
    target = tmp_path / "demo.colibri"
    for _ in range(2):
        assert main([*demo.convert_args(target), "--quiet"]) == 0
    assert main(["validate", str(target)]) == 0

"""The CLI's inspect and validate commands: happy paths, JSON views, exit codes, escaping."""

import json

import pytest

from colibri_format.cli import main
from colibri_format.synthetic import synthetic_model, write_synthetic


@pytest.fixture()
def small_file(tmp_path):
    return str(write_synthetic(tmp_path / "s.colibri", synthetic_model(dense_layers=(1,), layers=3, shared=32)))


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in ("inspect", "validate"):
        assert command in text


def test_inspect_json_is_complete(small_file, capsys):
    assert main(["inspect", small_file, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["header"]["magic"] == "COLIBRIv1"
    assert info["header"]["num_moe_layers"] == 2
    assert len(info["experts"]["entries"]) == 2 * 4
    assert info["dense_tensors"][0]["name"] == "embed_tokens"
    assert any(t["name"] == "layers.1.mlp.gate_proj" for t in info["dense_tensors"])


def test_inspect_human_view(small_file, capsys):
    assert main(["inspect", small_file]) == 0
    text = capsys.readouterr().out
    assert "COLIBRIv1" in text and "Expert blobs" in text


def test_validate_valid_and_corrupt(small_file, capsys):
    assert main(["validate", small_file, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["valid"] is True
    from colibri_format.inspect import inspect_file
    target = inspect_file(small_file)["experts"]["entries"][3]["offset"] + 100
    with open(small_file, "r+b") as f:   # one bit inside the fourth expert blob
        f.seek(target)
        byte = f.read(1)[0]
        f.seek(target)
        f.write(bytes([byte ^ 1]))
    assert main(["validate", small_file]) == 1
    assert "CorruptExpert" in capsys.readouterr().err


def test_validate_unreadable_exit_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert main(["validate", str(tmp_path / "missing.colibri")]) == 2


def test_inspect_bad_file_one_line_no_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.colibri"
    bad.write_bytes(b"GGUF" + bytes(1000))
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad magic" in err and "Traceback" not in err

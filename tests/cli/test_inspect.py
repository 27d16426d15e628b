"""`colibri inspect`: the JSON view is complete, the human view renders, a bad file is one line."""

import json

from colibri_format.cli import main


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


def test_inspect_bad_file_one_line_no_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.colibri"
    bad.write_bytes(b"GGUF" + bytes(1000))
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad magic" in err and "Traceback" not in err


def test_inspect_directory_is_unreadable_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err

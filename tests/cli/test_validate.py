"""`colibri validate`: the verdict is the exit code (0 valid, 1 invalid, 2 unreadable)."""

import json

from colibri_format.cli import main


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
    assert main(["validate", small_file, "--quick"]) == 0        # structure only: the blob is not hashed


def test_validate_human_view(small_file, capsys):
    assert main(["validate", small_file]) == 0
    assert "valid" in capsys.readouterr().out


def test_validate_unreadable_exit_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert main(["validate", str(tmp_path / "missing.colibri")]) == 2

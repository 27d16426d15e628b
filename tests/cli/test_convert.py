"""`colibri convert`: every option reaches the converter under its library name; the three views (table,
--json, --quiet); a bad checkpoint is one line. The conversion itself is tested in tests/convert."""

import json

import pytest

from colibri_format.cli import main

SUMMARY = {"output_path": "out.colibri", "architecture": "mixtral", "expert_format": "int8_row",
           "dense_dtype": "float16", "dense_tensors": 12, "experts": 8, "pieces_resumed": 0, "bytes_in": 4096,
           "bytes_out": 2048, "seconds": 0.5, "workers": 2, "quant_error_max": 1e-3, "quant_error_mean": 5e-4,
           "read_back": False, "gb_per_s": 8.192e-06}


class _Summary:
    def to_dict(self):
        return dict(SUMMARY)


@pytest.fixture()
def converter(monkeypatch):
    from colibri_format.convert import pipeline

    calls = []

    def fake_convert(model_path, output_path, **kw):
        calls.append((model_path, output_path, kw))
        if kw["progress"] is not None:
            kw["progress"](1, 2, 100, 200)
        return _Summary()

    monkeypatch.setattr(pipeline, "convert", fake_convert)
    return calls


def test_options_reach_the_converter(converter, tmp_path, capsys):
    assert main(["convert", "--model_path", str(tmp_path), "--output_path", str(tmp_path / "o.colibri"),
                 "--dtype", "bfloat16", "--quantize", "none", "--quant-bits", "8", "--group_size", "32",
                 "--num-experts", "8", "--top_k", "2", "--workers", "3", "--restart", "--verify",
                 "--allow-pickle", "--force", "--allow-unused-tensors", "--allow_non_finite", "--json"]) == 0
    (model_path, output_path, kw), = converter
    assert str(model_path) == str(tmp_path) and str(output_path) == str(tmp_path / "o.colibri")
    assert kw == {"dtype": "bfloat16", "quantize": "none", "quant_bits": 8, "group_size": 32, "num_experts": 8,
                  "top_k": 2, "workers": 3, "resume": False, "verify": True, "progress": None,
                  "allow_pickle": True, "force": True, "allow_unused_tensors": True, "allow_non_finite": True,
                  "scale_search": False}
    assert json.loads(capsys.readouterr().out) == SUMMARY


def test_defaults_table_and_quiet(converter, tmp_path, capsys):
    args = ["convert", "--model-path", str(tmp_path), "--output-path", str(tmp_path / "o.colibri")]
    assert main(args) == 0
    kw = converter[0][2]
    assert (kw["dtype"], kw["quantize"], kw["quant_bits"], kw["group_size"], kw["workers"]) == \
        ("float16", "expert", None, None, 2)                          # quant_bits None: 8, or 4 for mxfp4
    assert kw["resume"] is True and kw["verify"] is False and kw["allow_pickle"] is False
    assert kw["force"] is False and kw["allow_unused_tensors"] is False and kw["allow_non_finite"] is False
    assert kw["scale_search"] is False
    assert callable(kw["progress"])                                  # the progress bar's callback
    out = capsys.readouterr().out
    assert "colibri convert" in out and "mixtral" in out and "quant. error" in out
    assert "colibri validate" in out                                 # not read back: how to check the file
    assert main([*args, "--quiet"]) == 0
    assert converter[1][2]["progress"] is None and capsys.readouterr().out == ""


def test_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["convert", "--model-path", str(tmp_path / "none"), "--output-path", str(tmp_path / "o.colibri"),
                 "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_missing_required_option_is_a_usage_error(tmp_path, capsys):
    assert main(["convert", "--model-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--output-path" in err and "Traceback" not in err

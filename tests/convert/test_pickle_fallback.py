"""`colibri convert --allow-pickle`: a checkpoint with only pytorch_model.bin converts to the same
tensors as its safetensors twin; without the flag it is refused with a clear message."""

from pathlib import Path

import numpy as np

import colibri_format
from colibri_format.cli import main
from tests.hf_models import tiny_model


def _save_both(tmp_path: Path) -> tuple[Path, Path]:
    """The same weights as model.safetensors and as a pickled pytorch_model.bin (legacy HF names)."""
    import torch
    from safetensors.torch import load_file

    model = tiny_model("mixtral", seed=3)
    st, pt = tmp_path / "st", tmp_path / "pt"
    model.save_pretrained(st)
    pt.mkdir()
    (pt / "config.json").write_bytes((st / "config.json").read_bytes())
    torch.save(load_file(st / "model.safetensors"), pt / "pytorch_model.bin")
    return st, pt


def test_bin_checkpoint_needs_the_flag_then_matches_safetensors(tmp_path, capsys):
    st, pt = _save_both(tmp_path)
    out_pt, out_st = tmp_path / "pt.colibri", tmp_path / "st.colibri"
    assert main(["convert", "--model-path", str(pt), "--output-path", str(out_pt), "--quiet"]) == 1
    assert "allow_pickle" in capsys.readouterr().err and not out_pt.exists()
    for src, out, extra in ((pt, out_pt, ["--allow-pickle"]), (st, out_st, [])):
        assert main(["convert", "--model-path", str(src), "--output-path", str(out), "--dtype", "float32",
                     "--quantize", "none", "--quiet", *extra]) == 0
    with colibri_format.open(out_pt) as a, colibri_format.open(out_st) as b:
        assert a.dense_names() == b.dense_names()
        for name in a.dense_names():
            np.testing.assert_array_equal(a.dense(name), b.dense(name))
        for layer in a.model["moe_layers"]:
            for e in range(a.model["num_experts"]):
                np.testing.assert_array_equal(a.expert(layer, e).gate_up, b.expert(layer, e).gate_up)
                np.testing.assert_array_equal(a.expert(layer, e).down, b.expert(layer, e).down)

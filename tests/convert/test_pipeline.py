"""`colibri convert` end to end on tiny checkpoints of every supported architecture.

Each converted file is read back with the reader and compared with the canonical tensors of the same
checkpoint, read through the layout's spans (test_convert_adapters checks those against transformers):
exactly for `--dtype float32 --quantize none`, within the int8 bound `|w - q*scale| <= scale/2` (and fp16
rounding for dense tensors) otherwise; and `validate_file` passes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri_format
from colibri_format.cli import main as cli_main
from colibri_format.convert import layout
from colibri_format.convert.adapters import get_adapter
from colibri_format.convert.journal import journal_path_for, lock_path_for
from colibri_format.convert.pipeline import convert
from colibri_format.convert.source import open_checkpoint
from colibri_format.errors import InvalidInput, WriteError
from colibri_format.inspect import validate_file
from tests.convert.hf_checkpoint import expert_tensors, read_dense

# (arch, fused, sharded, tied, source dtype): every arch, each layout flag both ways across the set.
CASES = [
    ("mixtral", False, False, False, "float32"),
    ("mixtral", True, True, True, "bfloat16"),
    ("qwen2_moe", False, True, False, "float32"),
    ("qwen2_moe", True, False, True, "float32"),
    ("qwen3_moe", False, False, True, "bfloat16"),
    ("qwen3_moe", True, True, False, "float32"),
    ("olmoe", False, True, False, "float32"),
    ("olmoe", True, False, True, "bfloat16"),
    ("granitemoe", False, False, False, "float32"),
    ("granitemoe", True, True, True, "float32"),
    ("granitemoeshared", False, True, True, "float32"),
    ("granitemoeshared", True, False, False, "bfloat16"),
]


def _ids(case):
    arch, fused, sharded, tied, dtype = case
    return f"{arch}-{'fused' if fused else 'legacy'}-{'sharded' if sharded else 'single'}-" \
           f"{'tied' if tied else 'untied'}-{dtype}"


def _source_tensors(ckpt: Path):
    """Canonical dense tensors and experts as the layout's spans read them (float32)."""
    with open_checkpoint(ckpt) as src:
        adapter = get_adapter(src.config.model_type)
        model = adapter.normalize_config(src.config.raw)
        dense = {t.name: read_dense(src, t) for t in layout.dense_tensors(src, model, adapter.names)}
        experts = {(layer, e): expert_tensors(src, model, adapter, layer, e)
                   for layer in model["moe_layers"] for e in range(model["num_experts"])}
    return model, dense, experts


def _check_valid(path: Path) -> None:
    report = validate_file(path)
    assert report.valid, report.faults


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_float32_unquantized_is_exact(case, tiny_checkpoint, tmp_path):
    arch, fused, sharded, tied, dtype = case
    ckpt = tiny_checkpoint(arch, fused=fused, sharded=sharded, tie=tied, dtype=dtype)
    out = tmp_path / "m.colibri"
    summary = convert(ckpt, out, dtype="float32", quantize="none", workers=2)
    _check_valid(out)
    model, dense, experts = _source_tensors(ckpt)
    with colibri_format.open(out) as f:
        assert f.metadata["model"] == model
        assert sorted(f.dense_names()) == sorted(dense)
        for name, want in dense.items():
            np.testing.assert_array_equal(f.dense_f32(name), want, err_msg=name)
        for (layer, e), (gate, up, down) in experts.items():
            gate_up, down_got = f.expert_f32(layer, e)
            np.testing.assert_array_equal(gate_up, np.concatenate([gate, up]))
            np.testing.assert_array_equal(down_got, down)
    assert summary.experts == len(experts) and summary.quant_error_max is None
    assert not journal_path_for(out).exists() and not lock_path_for(out).exists()


def _assert_int8_bound(q: np.ndarray, scale: np.ndarray, w: np.ndarray) -> None:
    g = w.shape[1] // scale.shape[1]
    s = np.repeat(scale, g, axis=1)
    err = np.abs(w - q.astype(np.float32) * s)
    assert np.all(err <= s / 2 * (1 + 1e-5) + 1e-30), float((err - s / 2).max())


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_int8_experts_within_bound(case, tiny_checkpoint, tmp_path):
    arch, fused, sharded, tied, dtype = case
    ckpt = tiny_checkpoint(arch, fused=fused, sharded=sharded, tie=tied, dtype=dtype)
    out = tmp_path / "m.colibri"
    summary = convert(ckpt, out, dtype="float16", workers=2)
    _check_valid(out)
    _, dense, experts = _source_tensors(ckpt)
    with colibri_format.open(out) as f:
        for name, want in dense.items():
            np.testing.assert_array_equal(f.dense_f32(name), want.astype(np.float16).astype(np.float32))
        for (layer, e), (gate, up, down) in experts.items():
            v = f.expert(layer, e)
            _assert_int8_bound(v.gate_up, v.gate_up_scale, np.concatenate([gate, up]))
            _assert_int8_bound(v.down, v.down_scale, down)
        err = f.metadata["quantization"]["error"]
    assert len(err["per_expert"]) == len(experts)
    assert 0 < err["max_rel"] <= 0.5 / 127 + 1e-6
    assert summary.quant_error_max == err["max_rel"]


def test_group_quantization_and_bf16_dense(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("mixtral")
    out = tmp_path / "g.colibri"
    convert(ckpt, out, dtype="bfloat16", group_size=16)
    _check_valid(out)
    _, _, experts = _source_tensors(ckpt)
    with colibri_format.open(out) as f:
        assert f.metadata["quantization"]["experts"] == "int8_group"
        assert f.metadata["quantization"]["group_size"] == 16
        gate, up, down = experts[(1, 3)]
        v = f.expert(1, 3)
        _assert_int8_bound(v.gate_up, v.gate_up_scale, np.concatenate([gate, up]))
        _assert_int8_bound(v.down, v.down_scale, down)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_unquantized_experts_keep_their_dtype(tiny_checkpoint, tmp_path, dtype):
    """`--quantize none`: experts stored in --dtype; from a bf16 source to bf16 the bits are copied as is."""
    ckpt = tiny_checkpoint("qwen3_moe", fused=True, dtype="bfloat16")
    out = tmp_path / "u.colibri"
    convert(ckpt, out, dtype=dtype, quantize="none")
    _check_valid(out)
    _, _, experts = _source_tensors(ckpt)
    with colibri_format.open(out) as f:
        assert f.metadata["quantization"]["experts"] == dtype and f.metadata["quantization"]["error"] is None
        for (layer, e), (gate, up, down) in experts.items():
            gate_up, down_got = f.expert_f32(layer, e)
            want_gu, want_down = np.concatenate([gate, up]), down
            if dtype == "float16":
                want_gu, want_down = (a.astype(np.float16).astype(np.float32) for a in (want_gu, want_down))
            np.testing.assert_array_equal(gate_up, want_gu)
            np.testing.assert_array_equal(down_got, want_down)


def test_metadata_is_deterministic_and_path_free(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("qwen2_moe", sharded=True)
    a, b = tmp_path / "a.colibri", tmp_path / "b.colibri"
    convert(ckpt, a, workers=1)
    convert(ckpt, b, workers=4)
    assert a.read_bytes() == b.read_bytes()
    with colibri_format.open(a) as f:
        meta = f.metadata
    text = json.dumps(meta)
    assert str(tmp_path) not in text and str(ckpt) not in text
    prov = meta["provenance"]
    assert prov["source_format"] == "safetensors" and prov["tool"] == "colibri-format"
    assert prov["config_xxh3"] and prov["index_xxh3"]
    assert {f["name"] for f in prov["source_files"]} == {p.name for p in ckpt.glob("*.safetensors")}
    assert all(f["size"] == (ckpt / f["name"]).stat().st_size for f in prov["source_files"])
    assert meta["format"] == "colibri" and meta["architecture"] == "qwen2_moe"


def test_tokenizer_files_are_embedded(tiny_checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("olmoe"), ckpt)
    tok = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    cfg = {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}", "eos_token": "</s>"}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = tmp_path / "t.colibri"
    convert(ckpt, out)
    with colibri_format.open(out) as f:
        embedded = f.metadata["tokenizer"]
    assert json.loads(embedded["tokenizer_json"]) == tok
    assert embedded["tokenizer_config"] == cfg
    assert embedded["generation_config"]["eos_token_id"] == 2


def test_cli_convert_json_and_underscore_options(tiny_checkpoint, tmp_path, capsys):
    ckpt = tiny_checkpoint("granitemoe")
    out = tmp_path / "c.colibri"
    rc = cli_main(["convert", "--model_path", str(ckpt), "--output_path", str(out), "--num_experts", "4",
                   "--top_k", "2", "--quant_bits", "8", "--workers", "2", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["experts"] == 8 and summary["bytes_out"] == out.stat().st_size
    assert summary["architecture"] == "granitemoe" and summary["quant_error_max"] > 0
    _check_valid(out)


def test_cli_table_output(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "c.colibri"
    rc = cli_main(["convert", "--model-path", str(tiny_checkpoint("mixtral")), "--output-path", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "expert blobs" in text and "quant. error" in text


@pytest.mark.parametrize("flag, value, word", [("--num-experts", "8", "--num-experts 8"),
                                               ("--top-k", "3", "--top-k 3")])
def test_cli_expert_count_mismatch(tiny_checkpoint, tmp_path, capsys, flag, value, word):
    out = tmp_path / "x.colibri"
    rc = cli_main(["convert", "--model-path", str(tiny_checkpoint("mixtral")), "--output-path", str(out),
                   flag, value])
    assert rc == 1
    assert word in capsys.readouterr().err
    assert not out.exists() and not lock_path_for(out).exists()


@pytest.mark.parametrize("kwargs, field", [({"dtype": "int4"}, "dtype"), ({"quantize": "all"}, "quantize"),
                                          ({"quant_bits": 3}, "quant_bits"),
                                          ({"quantize": "none", "group_size": 16}, "group_size"),
                                          ({"workers": 0}, "workers"), ({"group_size": 24}, "group_size")])
def test_bad_options_are_invalid_input(tiny_checkpoint, tmp_path, kwargs, field):
    with pytest.raises(InvalidInput) as info:
        convert(tiny_checkpoint("mixtral"), tmp_path / "x.colibri", **kwargs)
    assert info.value.field == field
    assert not (tmp_path / "x.colibri").exists()


def test_lock_held_by_live_process_is_refused_and_stale_lock_taken(tiny_checkpoint, tmp_path):
    out = tmp_path / "l.colibri"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock_path_for(out).write_text(f"{holder.pid}\n")
        with pytest.raises(WriteError, match=f"pid {holder.pid}"):
            convert(tiny_checkpoint("mixtral"), out)
    finally:
        holder.kill()
        holder.wait()
    convert(tiny_checkpoint("mixtral"), out)  # the holder is gone: its lock is stale
    _check_valid(out)
    assert not lock_path_for(out).exists()


def test_output_path_must_be_a_file_in_an_existing_folder(tiny_checkpoint, tmp_path):
    with pytest.raises(InvalidInput):
        convert(tiny_checkpoint("mixtral"), tmp_path)
    with pytest.raises(InvalidInput):
        convert(tiny_checkpoint("mixtral"), tmp_path / "missing" / "x.colibri")


def test_not_enough_space_fails_early(tiny_checkpoint, tmp_path, monkeypatch):
    import collections

    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr("colibri_format.writer.shutil.disk_usage", lambda p: Usage(10, 10, 1000))
    out = tmp_path / "s.colibri"
    with pytest.raises(WriteError, match="more bytes") as info:
        convert(tiny_checkpoint("mixtral"), out)
    assert info.value.field == "free_space" and info.value.value > 1000
    assert not out.exists()


def test_no_torch_import_in_a_conversion(tiny_checkpoint, tmp_path):
    """The converter streams with NumPy only; importing torch would add ~1 s and hundreds of MB."""
    code = ("import sys; from colibri_format.cli import main; "
            f"rc = main(['convert', '--model-path', {str(tiny_checkpoint('mixtral'))!r}, '--output-path', "
            f"{str(tmp_path / 'n.colibri')!r}, '--quiet']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

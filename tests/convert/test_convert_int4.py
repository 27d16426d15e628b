"""int4_group experts (`--quant-bits 4 [--group-size 32|64|128]`): the quantizer's bound, nibble order and refusals,
and the converter end to end: the file, its size against int8, determinism, resume after a crash, the options.

Checkpoints are synthetic Mixtral-layout safetensors (colibri_format.synthetic) with H and I multiples of 32 (the
tiny transformers models have I = 16, which int4 cannot group).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import colibri_format
from colibri_format import spec as S
from colibri_format.cli import main as cli_main
from colibri_format.convert import crashpoint
from colibri_format.convert.pipeline import convert
from colibri_format.convert.quantize import quantize_int4, quantize_int4_into
from colibri_format.dequant import dequantize_matrix
from colibri_format.errors import InvalidInput, NonFiniteWeight, ResumeError
from colibri_format.inspect import validate_file
from tests.convert.synth_checkpoint import mixtral_config, write_checkpoint
from tests.convert.test_crash_resume import ENV, _cli, _leftovers

INT4 = S.ExpertFormat.INT4_GROUP
FINITE = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)


def _deq(q) -> np.ndarray:
    return dequantize_matrix(INT4, q.q, q.scale, np.float64)


# --- the quantizer -----------------------------------------------------------------------------------------------
@st.composite
def weight_and_group(draw) -> tuple[np.ndarray, int]:
    group = draw(st.sampled_from([2, 4, 32, 64]))
    w = draw(arrays(np.float32, (draw(st.integers(1, 5)), group * draw(st.integers(1, 4))), elements=FINITE))
    if draw(st.booleans()):
        w[:, :group] = 0.0                                           # an all-zero group
    return w, group


@settings(max_examples=150, deadline=None)
@given(weight_and_group())
def test_error_is_at_most_half_a_step_and_nothing_clips(case) -> None:
    w, g = case
    q = quantize_int4(w, g)
    assert q.q.dtype == np.uint8 and q.q.shape == (w.shape[0], w.shape[1] // 2)
    assert q.scale.dtype == np.float16 and q.scale.shape == (w.shape[0], w.shape[1] // g)
    codes = dequantize_matrix(INT4, q.q, np.ones_like(q.scale), np.float64)
    assert np.abs(codes).max() <= 7                                    # -8 is never written
    amax = np.abs(w.astype(np.float64)).reshape(w.shape[0], -1, g).max(-1)
    scale = q.scale.astype(np.float64)
    assert np.all((scale >= amax / 7) | (amax == 0)) and np.all(scale[amax == 0] == 1.0)
    step = np.repeat(scale, g, axis=1)
    err = np.abs(w.astype(np.float64) - _deq(q))
    assert np.all(err <= step / 2)
    row = np.abs(w.astype(np.float64)).max(axis=1, keepdims=True)
    rel = np.divide(err, row, out=np.zeros_like(err), where=row > 0)
    assert q.max_rel_err == pytest.approx(rel.max(), rel=1e-4, abs=1e-7)
    assert q.mean_rel_err == pytest.approx(rel.mean(), rel=1e-4, abs=1e-7)


def test_nibble_order_and_twos_complement() -> None:
    """Input 2k in the low nibble of byte k, 2k+1 in the high nibble; negative values in two's complement."""
    w = np.array([[7, -7, 1, -1, 0, 3, -3, 2] * 4], np.float32)       # one group of 32 with max|w| = 7
    q = quantize_int4(w, 32)
    assert q.scale[0, 0] == 1.0
    assert q.q[0, :4].tolist() == [0x97, 0xF1, 0x30, 0x2D]            # (7, -7) (1, -1) (0, 3) (-3, 2)
    np.testing.assert_array_equal(_deq(q), w)


def test_scale_is_rounded_up_to_a_float16() -> None:
    w = np.full((1, 32), 0.1, np.float32)                              # 0.1 / 7 is not a float16
    q = quantize_int4(w, 32)
    s = float(q.scale[0, 0])
    assert s >= 0.1 / 7 and np.float16(s) == q.scale[0, 0]
    assert s == float(np.nextafter(np.float16(np.float64(np.float32(0.1)) / 7), np.float16(1)))


@settings(max_examples=80, deadline=None)
@given(weight_and_group())
def test_scale_search_never_worsens_a_group(case) -> None:
    """--scale-search keeps max|w|/7 unless another float16 scale has a strictly smaller squared error; q in [-8, 7]."""
    w, g = case
    rtn, found = quantize_int4(w, g), quantize_int4(w, g, search=True)
    sq = lambda q: ((w.astype(np.float64) - _deq(q)) ** 2).reshape(w.shape[0], -1, g).sum(-1)  # noqa: E731
    assert np.all(sq(found) <= sq(rtn))
    codes = dequantize_matrix(INT4, found.q, np.ones_like(found.scale), np.float64)
    assert codes.min() >= -8 and codes.max() <= 7
    zero = np.abs(w).reshape(w.shape[0], -1, g).max(-1) == 0
    assert np.all(found.scale[zero] == 1.0)


def test_scale_search_lowers_the_error_of_gaussian_weights() -> None:
    w = np.random.default_rng(5).standard_normal((256, 256)).astype(np.float32)
    rtn, found = quantize_int4(w, 32), quantize_int4(w, 32, search=True)
    err = lambda q: float(np.sqrt(((w - _deq(q)) ** 2).mean()))  # noqa: E731
    assert err(found) < 0.9 * err(rtn)
    assert found.mean_rel_err < rtn.mean_rel_err
    assert (found.scale < 0).any()                     # some groups use the range [-8, 7] whole, sign flipped


@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", np.float16, np.float32, np.float64])
def test_stored_chunks_and_row_blocks_give_the_same_bits(dtype, search, monkeypatch) -> None:
    """Chunk by chunk in any stored dtype, and in row blocks of any size, the bytes are those of the whole matrix."""
    from colibri_format.convert import quantize as qz

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((37, 128)) * 0.02).astype(np.float32)
    stored = (w.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bf16" else w.astype(dtype)
    as32 = (stored.astype(np.uint32) << 16).view(np.float32) if dtype == "bf16" else stored.astype(np.float32)
    whole = quantize_int4(as32, 64, search=search)
    monkeypatch.setattr(qz, "BLOCK_BYTES", 7 * 4 * 128)               # blocks of 7 rows
    q = np.empty_like(whole.q)
    scale = np.empty_like(whole.scale)
    for lo in range(0, 37, 10):
        quantize_int4_into(stored[lo:lo + 10], 64, q[lo:lo + 10], scale[lo:lo + 10], search=search)
    np.testing.assert_array_equal(q, whole.q)
    np.testing.assert_array_equal(scale, whole.scale)


@pytest.mark.parametrize("value, word", [(np.nan, "NaN"), (np.inf, "+inf"), (5e5, "too large")])
def test_non_finite_and_too_large_values_are_named(value, word) -> None:
    w = np.zeros((4, 64), np.float32)
    w[2, 37] = value
    with pytest.raises(NonFiniteWeight) as info:
        quantize_int4(w, 32)
    assert word in str(info.value) and "[2, 37]" in str(info.value)
    quantize_int4(np.full((1, 32), 7 * 65504.0, np.float32), 32)        # the largest storable group


@pytest.mark.parametrize("group", [0, 3, 48, None, True])
def test_bad_group_is_invalid_input(group) -> None:
    with pytest.raises(InvalidInput):
        quantize_int4(np.zeros((2, 64), np.float32), group)


# --- the converter -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """bf16, 2 layers x 4 experts, H 128, I 128: every int4 group size divides both."""
    d = tmp_path_factory.mktemp("int4ckpt")
    write_checkpoint(d, mixtral_config(vocab=96, hidden=128, layers=2, experts=4, inter=128, heads=4),
                     shard_bytes=160 << 10)
    return d


def _source_experts(path):
    from tests.convert.test_pipeline import _source_tensors
    return _source_tensors(path)[2]


def _digest(path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


@pytest.mark.parametrize("group", S.INT4_GROUP_SIZES)
def test_int4_file_holds_the_quantized_source(ckpt, tmp_path, group) -> None:
    out = tmp_path / "q.colibri"
    summary = convert(ckpt, out, quant_bits=4, group_size=group, workers=2)
    assert validate_file(out).valid
    assert summary.expert_format == "int4_group"
    experts = _source_experts(ckpt)
    with colibri_format.open(out) as f:
        assert (f.header.version_minor, f.header.expert_format, f.header.group_size) == (1, int(INT4), group)
        assert f.metadata["spec_version"] == "1.1"
        quant = f.metadata["quantization"]
        assert (quant["experts"], quant["bits"], quant["group_size"]) == ("int4_group", 4, group)
        for (layer, e), (gate, up, down) in experts.items():
            v = f.expert(layer, e)
            for q, scale, w in ((v.gate_up, v.gate_up_scale, np.concatenate([gate, up])), (v.down, v.down_scale, down)):
                ref = quantize_int4(w, group)                       # the same quantizer on the source values
                np.testing.assert_array_equal(q, ref.q)
                np.testing.assert_array_equal(scale, ref.scale)
            gu, dn = f.expert_f32(layer, e)
            assert np.abs(dn - down).max() <= float(np.abs(down).max()) / 14 * (1 + 1e-3)
        assert 0 < quant["error"]["max_rel"] <= 0.5 / 7 + 1e-6
    assert summary.quant_error_max == quant["error"]["max_rel"]


def test_int4_g32_experts_take_at_most_057_of_int8(ckpt, tmp_path) -> None:
    convert(ckpt, tmp_path / "i8.colibri", quant_bits=8)
    convert(ckpt, tmp_path / "i4.colibri", quant_bits=4)                  # group 32 by default
    with colibri_format.open(tmp_path / "i8.colibri") as i8, colibri_format.open(tmp_path / "i4.colibri") as i4:
        assert i4.header.group_size == 32
        ratio = i4.header.expert_blob_size / i8.header.expert_blob_size
    assert ratio <= 0.57, ratio
    # at a real model's width (Mixtral-8x7B: H 4096, I 14336) the blobs are 0.5625 of int8_row's
    big = [S.blob_layout(4096, 14336, fmt, g).size for fmt, g in ((S.ExpertFormat.INT8_ROW, 0), (INT4, 32))]
    assert big[1] / big[0] <= 0.5626


def test_scale_search_file(ckpt, tmp_path) -> None:
    """--scale-search: the same quantizer as quantize_int4(search=True), recorded in the metadata; the journal
    keeps a search run's pieces from a plain run's."""
    out = tmp_path / "s.colibri"
    convert(ckpt, out, quant_bits=4, group_size=32, scale_search=True, workers=2)
    assert validate_file(out).valid
    (gate, up, down), = [v for k, v in _source_experts(ckpt).items() if k == (1, 2)]
    with colibri_format.open(out) as f:
        assert f.metadata["quantization"]["scale_search"] == "least_squares"
        v = f.expert(1, 2)
        ref = quantize_int4(down, 32, search=True)
        np.testing.assert_array_equal(v.down, ref.q)
        np.testing.assert_array_equal(v.down_scale, ref.scale)
        err = f.metadata["quantization"]["error"]["mean_rel"]
    convert(ckpt, tmp_path / "r.colibri", quant_bits=4, group_size=32)
    with colibri_format.open(tmp_path / "r.colibri") as f:
        assert "scale_search" not in f.metadata["quantization"]
        assert err < f.metadata["quantization"]["error"]["mean_rel"]


def test_int4_conversion_is_deterministic_across_workers(ckpt, tmp_path) -> None:
    convert(ckpt, tmp_path / "a.colibri", quant_bits=4, group_size=64, workers=1)
    convert(ckpt, tmp_path / "b.colibri", quant_bits=4, group_size=64, workers=3)
    assert _digest(tmp_path / "a.colibri") == _digest(tmp_path / "b.colibri")


def test_int4_resumes_after_a_crash_byte_identical(ckpt, tmp_path) -> None:
    clean = tmp_path / "clean.colibri"
    crashpoint.reset()
    convert(ckpt, clean, quant_bits=4, workers=1)
    points = crashpoint.count()
    for n in sorted({3, points // 2, points - 3}):
        out = tmp_path / f"crash{n}" / "m.colibri"
        out.parent.mkdir()
        done = subprocess.run(_cli(ckpt, out, "--workers", "1", "--quant-bits", "4"),
                              env={**ENV, "COLIBRI_CRASH_AT": str(n)}, capture_output=True, timeout=120)
        assert done.returncode == -signal.SIGKILL, (n, done.stderr[-2000:])
        assert not out.exists()
        if n == points // 2:           # the journal ties the pieces to their options: 8 bits cannot take them over
            with pytest.raises(ResumeError, match="--restart"):
                convert(ckpt, out, quant_bits=8, workers=2)
        convert(ckpt, out, quant_bits=4, workers=2)
        assert _digest(out) == _digest(clean), n
        assert _leftovers(out) == []


@pytest.mark.parametrize("kwargs, field", [
    ({"quant_bits": 3}, "quant_bits"), ({"quant_bits": 16}, "quant_bits"),
    ({"quant_bits": 4, "group_size": 16}, "group_size"), ({"quant_bits": 4, "group_size": 48}, "group_size"),
    ({"quant_bits": 4, "group_size": 256}, "group_size"), ({"quantize": "none", "quant_bits": 4}, "quant_bits"),
    ({"quantize": "mxfp4", "quant_bits": 8}, "quant_bits"), ({"quantize": "mxfp4", "group_size": 64}, "group_size"),
    ({"scale_search": True}, "scale_search"), ({"quantize": "mxfp4", "scale_search": True}, "scale_search"),
])
def test_bad_4bit_options_are_invalid_input(ckpt, tmp_path, kwargs, field) -> None:
    with pytest.raises(InvalidInput) as info:
        convert(ckpt, tmp_path / "x.colibri", **kwargs)
    assert info.value.field == field
    assert list(tmp_path.iterdir()) == []


def test_int4_group_that_does_not_divide_the_model_is_refused_before_writing(tmp_path) -> None:
    d = tmp_path / "ckpt"
    write_checkpoint(d, mixtral_config(vocab=64, hidden=128, layers=1, experts=2, inter=96, heads=4))
    with pytest.raises(InvalidInput, match="int4_group needs 32, 64 or 128 dividing") as info:
        convert(d, tmp_path / "x.colibri", quant_bits=4, group_size=64)
    assert info.value.field == "group_size"
    assert not (tmp_path / "x.colibri").exists()


def test_too_large_weight_names_the_tensor_and_element(tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "ckpt"
    write_checkpoint(d, mixtral_config(vocab=64, hidden=64, layers=1, experts=2, inter=32, heads=4), dtype="float32")
    shard = next(d.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    tensors[name][5, 9] = 1e6                                          # over 7 x 65504
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeight, match="int4") as info:
        convert(d, tmp_path / "x.colibri", quant_bits=4, workers=1)
    assert info.value.field == name and "[5, 9]" in str(info.value) and "expert 1 of layer 0" in str(info.value)
    convert(d, tmp_path / "x8.colibri", quant_bits=8, workers=1)         # int8's float32 scales hold it


def test_cli_quant_bits_4(ckpt, tmp_path, capsys) -> None:
    import json

    out = tmp_path / "c.colibri"
    assert cli_main(["convert", "--model-path", str(ckpt), "--output-path", str(out), "--quant-bits", "4",
                     "--group-size", "128", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["expert_format"] == "int4_group"
    assert cli_main(["inspect", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["header"]["expert_format_name"] == "int4_group" and info["header"]["group_size"] == 128
    assert [a["dtype"] for a in info["experts"]["arrays"]] == ["i4x2", "f16", "i4x2", "f16"]
    assert cli_main(["validate", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(["convert", "--model-path", str(ckpt), "--output-path", str(tmp_path / "d.colibri"),
                     "--quant-bits", "4", "--group-size", "48"]) != 0
    assert "group" in capsys.readouterr().err


def test_python_m_colibri_quant_bits_4_runs(ckpt, tmp_path) -> None:
    """The CLI in a fresh process, as a user types it."""
    out = tmp_path / "p.colibri"
    subprocess.run([sys.executable, "-m", "colibri_format", "convert", "--model-path", str(ckpt), "--output-path",
                    str(out), "--quant-bits", "4", "--quiet"], env=ENV, check=True, timeout=120)
    assert validate_file(out).valid

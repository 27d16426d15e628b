"""The converter's fast paths give the bytes the plain paths gave (project issue 20).

- `cast.bf16_to_f16` against NumPy's cast on every bf16 pattern;
- `quantize_into` against `quantize_int8(to_float32(chunk))`, bit for bit (q, scales, both errors), on every
  source dtype, group size, block boundary and the tiny/zero/non-finite corners;
- the writer's per-thread write buffer (`stream(key, buffered=True)`, `reserve`/`commit`, `flush`) against
  plain streams, with buffers small enough to force every path;
- runs of pieces (`schedule.runs`, `PartialRun`), positional chunk reads (`rows.iter_span_chunks`);
- whole conversions: the same file for any worker count, run size and buffer size, and the bytes the
  converter wrote before these changes (pinned digests of the data region and of the error statistics).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri_format
from colibri_format import spec as S
from colibri_format import writer as writer_mod
from colibri_format.convert import native
from colibri_format.convert import quantize as qmod
from colibri_format.convert import schedule
from colibri_format.convert.cast import bf16_to_f16
from colibri_format.convert.layout import RowSpan
from colibri_format.convert.pipeline import convert
from colibri_format.convert.quantize import quantize_int4_into, quantize_int8, quantize_into
from colibri_format.convert.rows import iter_span_chunks
from colibri_format.convert.source import open_checkpoint
from colibri_format.dtypes import to_float32, to_storage
from colibri_format.errors import InvalidInput, NonFiniteWeight, WriteError
from colibri_format.inspect.validate import validate_file
from colibri_format.writer import ColibriWriter
from tests.convert.synth_checkpoint import mixtral_config, write_checkpoint


@contextlib.contextmanager
def numpy_loops() -> Iterator[None]:
    """The converter's NumPy loops even where the compiled ones (convert/native.py) are built."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "library", lambda: None)
        yield


# --- bf16 -> float16 ---------------------------------------------------------------------------------------------
def _numpy_f16(bits: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return to_storage(to_float32(bits), S.DType.F16).view(np.uint16)


@pytest.mark.parametrize("loops", ["compiled where built", "numpy"])
def test_bf16_to_f16_matches_numpy_on_every_pattern(loops):
    with numpy_loops() if loops == "numpy" else contextlib.nullcontext():
        _bf16_to_f16_on_every_pattern()


def _bf16_to_f16_on_every_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.size, np.uint16)
    assert bf16_to_f16(bits, out) is False  # inf, NaN and beyond-65504 patterns are among them
    assert np.array_equal(out, _numpy_f16(bits))
    finite = bits[(bits & 0x7FFF) < 0x4780]  # below 65536 in magnitude: every float16 image is finite
    out = np.empty(finite.size, np.float16)
    assert bf16_to_f16(finite, out) is True
    assert np.array_equal(out.view(np.uint16), _numpy_f16(finite))


def test_bf16_to_f16_shapes_and_sizes():
    rng = np.random.default_rng(0)
    bits = (rng.standard_normal((37, 50), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    out = np.empty((37, 50), np.float16)
    assert bf16_to_f16(bits, out)
    assert np.array_equal(out.view(np.uint16), _numpy_f16(bits))
    assert bf16_to_f16(bits[:, ::2], np.empty(37 * 25, np.uint16))  # a strided source is copied first
    assert bf16_to_f16(np.empty(0, np.uint16), np.empty(0, np.uint16))
    with pytest.raises(ValueError):
        bf16_to_f16(bits, np.empty(5, np.uint16))


# --- quantize_into ----------------------------------------------------------------------------------------------
def _stored(w: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    with np.errstate(over="ignore"):  # float16 beyond 65504: inf, refused by both quantizers
        return w.astype({"float16": np.float16, "float32": np.float32, "float64": np.float64}[dtype])


def _same(chunk: np.ndarray, group: int | None) -> None:
    """quantize_into (the compiled loops where built) gives what quantize_int8 gives with NumPy's loops."""
    n_out, n_in = chunk.shape
    q = np.full((n_out, n_in), 99, np.int8)
    scale = np.full((n_out, n_in // (group or n_in)), -1, np.float32)
    try:
        with np.errstate(all="ignore"), numpy_loops():
            ref = quantize_int8(to_float32(chunk), group)
    except NonFiniteWeight as exc:
        with pytest.raises(NonFiniteWeight) as info:
            quantize_into(chunk, group, q, scale)
        assert str(info.value) == str(exc)
        return
    max_rel, mean_rel = quantize_into(chunk, group, q, scale)
    assert np.array_equal(q, ref.q)
    assert np.array_equal(scale.view(np.uint32), ref.scale.view(np.uint32))
    assert (max_rel, mean_rel) == (ref.max_rel_err, ref.mean_rel_err)  # the same floats, not close ones


@st.composite
def chunks(draw: st.DrawFn) -> tuple[np.ndarray, int | None]:
    group = draw(st.sampled_from([None, 4, 16, 32, 64]))
    n_in = (group or 16) * draw(st.integers(1, 8))
    n_out = draw(st.integers(1, 90))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    magnitude = draw(st.sampled_from([1e-40, 1e-30, 1e-3, 1.0, 3e4]))
    w = (rng.standard_normal((n_out, n_in)) * magnitude).astype(np.float32)
    if draw(st.booleans()):
        w[rng.integers(0, n_out)] = 0.0                 # a zero row
    if draw(st.booleans()):
        w[:, :(group or n_in)] = 0.0                    # zero groups
    return _stored(w, draw(st.sampled_from(["bfloat16", "float16", "float32", "float64"]))), group


@settings(max_examples=200, deadline=None)
@given(chunks())
def test_quantize_into_is_quantize_int8_bit_for_bit(case):
    _same(*case)


def _same4(chunk: np.ndarray, group: int, search: bool = False) -> None:
    """quantize_int4_into with the compiled loop (where built) gives the NumPy loop's packed q, scales and errors,
    round-to-nearest or searched."""
    n_out, n_in = chunk.shape

    def run():
        q = np.full((n_out, n_in // 2), 0xAB, np.uint8)
        scale = np.full((n_out, n_in // group), -1, np.float16)
        return quantize_int4_into(chunk, group, q, scale, search=search), q, scale.view(np.uint16)

    try:
        with np.errstate(all="ignore"), numpy_loops():
            ref = run()
    except NonFiniteWeight as exc:
        with pytest.raises(NonFiniteWeight) as info:
            run()
        assert str(info.value) == str(exc)
        return
    got = run()
    assert got[0] == ref[0]                      # the same floats, not close ones
    assert np.array_equal(got[1], ref[1]) and np.array_equal(got[2], ref[2])


@st.composite
def int4_chunks(draw: st.DrawFn) -> tuple[np.ndarray, int, bool]:
    group = draw(st.sampled_from([2, 8, 12, 32, 64, 128]))           # small and ragged ones: the search's lane sums
    n_in = group * draw(st.integers(1, 6))
    n_out = draw(st.integers(1, 70))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitude = draw(st.sampled_from([1e-40, 1e-30, 1e-9, 1e-7, 1e-3, 1.0, 3e4, 1e6]))  # tiny: below float16
    w = (rng.standard_normal((n_out, n_in)) * magnitude).astype(np.float32)
    if draw(st.booleans()):
        w[rng.integers(0, n_out)] = 0.0                 # a zero row
    if draw(st.booleans()):
        w[:, :group] = 0.0                              # zero groups
    return _stored(w, draw(st.sampled_from(["bfloat16", "float16", "float32"]))), group, draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(int4_chunks())
def test_int4_compiled_loop_is_the_numpy_loop_bit_for_bit(case):
    _same4(*case)


def test_int4_errors_of_weights_below_the_smallest_float16_step():
    """A row of 1e-30 weights: every q is 0 (its scale is float16's smallest step), so each relative error is 1;
    the error units of such a group are fine enough to say so (whole ERROR_UNITS of the scale would round it to 0)."""
    w = np.full((2, 64), 1e-30, np.float32)
    w[1, ::2] = -3e-31
    for loops in (numpy_loops(), contextlib.nullcontext()):
        with loops:
            q = np.empty((2, 32), np.uint8)
            scale = np.empty((2, 2), np.float16)
            max_rel, mean_rel = quantize_int4_into(w, 32, q, scale)
        assert not q.any() and max_rel == pytest.approx(1.0, rel=1e-6)
        assert mean_rel == pytest.approx(1.0 / 2 + (0.5 * 0.3 + 0.5) / 2, rel=1e-6)


def test_int4_compiled_loop_on_real_widths_and_every_code():
    """Qwen3-sized rows in bf16 and float32, and a row that takes every code -7..7 at half-step ties."""
    rng = np.random.default_rng(4)
    for dtype in ("bfloat16", "float32"):
        for group in (32, 128):
            _same4(_stored(rng.standard_normal((300, 2048), dtype=np.float32) * 0.02, dtype), group)
    ties = np.tile(np.arange(-7, 7.5, 0.5, dtype=np.float32)[:29], 3)[:64].reshape(1, 64)
    ties[0, 0] = 7.0                                    # the group's max: scale 1 exactly, so x = w
    for search in (False, True):
        _same4(ties, 32, search)
        _same4(_stored(ties, "bfloat16"), 64, search)
        _same4(_stored(rng.standard_normal((40, 2048), dtype=np.float32) * 0.02, "bfloat16"), 32, search)


@pytest.mark.skipif(bool(os.environ.get("COLIBRI_NO_NATIVE")), reason="COLIBRI_NO_NATIVE is set")
def test_the_compiled_loops_are_built_where_a_c_compiler_is():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the converter runs its NumPy loops")
    assert native.library() is not None, "colibri_format/convert/_native.c is not built: run `make install-dev`"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("group", [None, 32, 128])
def test_quantize_into_on_real_widths_and_ragged_blocks(monkeypatch, dtype, group):
    rng = np.random.default_rng(1)
    for n_out, n_in in ((512, 2048), (300, 768), (7, 4096)):
        _same(_stored(rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.02, dtype), group)
    monkeypatch.setattr(qmod, "BLOCK_BYTES", 7 * 256 * 4)  # 7 rows a block, a ragged last one
    _same(_stored(rng.standard_normal((100, 256), dtype=np.float32), dtype), group if group != 128 else 64)


@pytest.mark.parametrize("unbuffered", [0, 1 << 30])
@pytest.mark.parametrize("small", [0, 1 << 20])
def test_quantize_into_whatever_the_reduction_and_division_paths(monkeypatch, unbuffered, small):
    monkeypatch.setattr(qmod, "UNBUFFERED_GROUP", unbuffered)
    monkeypatch.setattr(qmod, "SMALL_GROUP", small)
    rng = np.random.default_rng(2)
    w = _stored(rng.standard_normal((40, 1024), dtype=np.float32), "bfloat16")
    for group in (None, 16, 64, 512):
        _same(w, group)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("value, word", [(np.nan, "NaN"), (np.inf, "+inf"), (-np.inf, "-inf")])
def test_quantize_into_refuses_what_quantize_int8_refuses(dtype, value, word):
    w = np.ones((200, 1024), np.float32)
    w[150, 1000] = value
    chunk = _stored(w, dtype)
    with pytest.raises(NonFiniteWeight, match=rf"weight holds {re.escape(word)} at index \[150, 1000\]"):
        quantize_into(chunk, None, np.empty(w.shape, np.int8), np.empty((200, 1), np.float32))
    if dtype == "float64":  # beyond float32: infinite once narrowed, as quantize_int8(to_float32(...)) sees it
        big = np.ones((4, 16)) * 1e300
        with pytest.raises(NonFiniteWeight):
            quantize_into(big, None, np.empty((4, 16), np.int8), np.empty((4, 1), np.float32))


def test_error_maxima_on_int32_patterns_are_the_float_maxima():
    """`_abs_error_max` (one reduceat over the int32 patterns) against NumPy's float maximum, on values >= +0 with
    zeros, subnormals and ties, for group sizes on both sides of ERR_REDUCEAT_GROUP; `out` filled in place."""
    rng = np.random.default_rng(5)
    for g in (1, 8, 16, 31, 32, 64, 96, 128, 768, 2048):
        x = np.abs(rng.standard_normal((13, 4, g), dtype=np.float32)) * np.float32(0.5)
        x[0] = 0.0                                          # whole zero rows
        x[1, :, : (g + 1) // 2] = np.float32(1e-45)         # the smallest subnormal, and ties with it
        x[2, 1] = np.float32(0.5)                           # a group of equal values
        ref = np.maximum.reduce(x, axis=2)
        got = qmod._abs_error_max(x)
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), ref.view(np.uint32))
        out = np.full((13, 4), -1.0, np.float32)
        assert qmod._abs_error_max(x, out) is out and np.array_equal(out, ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_group_maxima_by_reduceat_are_the_plain_maxima(dtype):
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((9, 768), dtype=np.float32) * 0.02)
    w[3] = 0.0
    w[4, ::5] = -w[4, ::5]
    chunk = _stored(w, dtype)
    for g in (16, 32, 64, 128, 256, 768):
        ref = np.abs(to_float32(chunk)).reshape(9, 768 // g, g).max(axis=2)
        assert np.array_equal(qmod._group_maxima(chunk, g), ref)


@pytest.mark.parametrize("err_group, mag_group", [(1, 1), (1 << 30, 1 << 30)])
def test_quantizers_whatever_the_maxima_paths(monkeypatch, err_group, mag_group):
    """The reduceat maxima (all group sizes, or none) give the bytes of the default thresholds: int8 through
    quantize_into (against quantize_int8, itself on the forced path) and int4 (both scale choices)."""
    from colibri_format.convert.quantize import quantize_int4_into

    rng = np.random.default_rng(7)
    w = rng.standard_normal((70, 768), dtype=np.float32) * 0.05
    w[5] = 0.0
    w[6, :64] = 0.0
    cases = [(_stored(w, dtype), group) for dtype in ("bfloat16", "float16", "float32")
             for group in (None, 16, 32, 64, 128)]

    def int4(chunk, group, search):
        q = np.empty((chunk.shape[0], chunk.shape[1] // 2), np.uint8)
        scale = np.empty((chunk.shape[0], chunk.shape[1] // group), np.float16)
        errors = quantize_int4_into(chunk, group, q, scale, search=search)
        return errors, q, scale.view(np.uint16)

    expected = [int4(chunk, group, search) for chunk, group in cases if group in (32, 64, 128)
                for search in (False, True)]
    monkeypatch.setattr(qmod, "ERR_REDUCEAT_GROUP", err_group)
    monkeypatch.setattr(qmod, "MAG_REDUCEAT_GROUP", mag_group)
    for chunk, group in cases:
        _same(chunk, group)
    got = [int4(chunk, group, search) for chunk, group in cases if group in (32, 64, 128)
           for search in (False, True)]
    for (e_err, e_q, e_s), (g_err, g_q, g_s) in zip(expected, got):
        assert e_err == g_err and np.array_equal(e_q, g_q) and np.array_equal(e_s, g_s)


def test_int4_packing_is_the_strided_nibble_packing():
    """`_pack_nibbles` (the int8 codes read as uint16 pairs) against the byte-slice packing it replaced: every pair of
    codes in [-8, 7], several block shapes, a strided destination."""
    every = np.array([(a, b) for a in range(-8, 8) for b in range(-8, 8)], np.float32).reshape(1, -1)  # 256 pairs
    rng = np.random.default_rng(8)
    for r in (every.reshape(1, 16, 32), every.reshape(4, 4, 32),
              rng.integers(-8, 8, (9, 24, 64)).astype(np.float32), rng.integers(-8, 8, (1, 1, 2)).astype(np.float32)):
        rows, n_in = r.shape[0], r.shape[1] * r.shape[2]
        codes = r.astype(np.int8).view(np.uint8).reshape(rows, n_in)
        ref = (codes[:, 0::2] & np.uint8(0x0F)) | ((codes[:, 1::2] & np.uint8(0x0F)) << np.uint8(4))
        out = np.full((rows, n_in // 2), 0xAA, np.uint8)
        qmod._pack_nibbles(r, out)
        assert np.array_equal(out, ref)
        wide = np.full((rows, n_in), 0xAA, np.uint8)
        qmod._pack_nibbles(r, wide[:, ::2])                  # a strided destination is filled in place
        assert np.array_equal(wide[:, ::2], ref) and (wide[:, 1::2] == 0xAA).all()


def test_quantize_into_checks_its_buffers():
    chunk = np.ones((4, 16), np.float32)
    with pytest.raises(InvalidInput):
        quantize_into(chunk, None, np.empty((4, 8), np.int8), np.empty((4, 1), np.float32))
    with pytest.raises(InvalidInput):
        quantize_into(chunk, 8, np.empty((4, 16), np.int8), np.empty((4, 1), np.float32))
    with pytest.raises(InvalidInput):
        quantize_into(chunk.astype(np.int32), None, np.empty((4, 16), np.int8), np.empty((4, 1), np.float32))
    with pytest.raises(InvalidInput):
        quantize_into(chunk, 3, np.empty((4, 16), np.int8), np.empty((4, 5), np.float32))


# --- the write buffer -------------------------------------------------------------------------------------------
def _model() -> dict:
    from colibri_format.synthetic import synthetic_model

    return synthetic_model(vocab=64, hidden=32, layers=2, experts=4)


def _blob_bytes(writer: ColibriWriter, key, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, writer.slot(key).size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("capacity", [4096, 5000, 3 * 4096, 1 << 20])
def test_buffered_streams_write_what_plain_streams_write(tmp_path, monkeypatch, capacity):
    monkeypatch.setattr(writer_mod, "WRITE_BUFFER_BYTES", capacity)
    files = {}
    for buffered in (False, True):
        w = ColibriWriter(tmp_path / f"{buffered}.colibri", _model(), dense_dtype=S.DType.F16,
                          expert_format=S.ExpertFormat.INT8_ROW)
        keys = w.plan.blob_keys()
        for i, key in enumerate(keys):
            data = _blob_bytes(w, key, i)
            stream = w.stream(key, buffered=buffered)
            cuts = sorted({0, len(data)} | {c for c in (100, 3000, 5000, len(data) // 2) if c < len(data)})
            for a, b in zip(cuts, cuts[1:]):
                if buffered and i % 2:  # in place, where the buffer has room
                    room = stream.reserve(b - a)
                    if room is None:
                        stream.put(data[a:b])
                    else:
                        room[:] = np.frombuffer(data[a:b], np.uint8)
                        stream.commit(b - a)
                else:
                    stream.put(data[a:b])
            stream.finish()
            if buffered and i == 2:
                w.flush()  # a flush in the middle: the buffer starts again at the next blob
        w.flush()
        files[buffered] = (os.pread(w._fd, w.plan.metadata_offset, 0), dict(w.checksums))
        w.abort(remove_part=True)
    assert files[True] == files[False]
    assert len(files[True][1]) == len(_model()["moe_layers"]) * _model()["num_experts"]


def test_a_buffered_piece_counts_only_once_written(tmp_path):
    w = ColibriWriter(tmp_path / "m.colibri", _model(), dense_dtype=S.DType.F16, expert_format=S.ExpertFormat.INT8_ROW)
    writes = []
    real = w._write_at
    w._write_at = lambda data, offset: (writes.append((offset, len(data))), real(data, offset))
    key = w.plan.blob_keys()[0]
    stream = w.stream(key, buffered=True)
    stream.put(_blob_bytes(w, key, 0))
    checksum = stream.finish()
    assert key not in w.checksums and writes == []
    w.flush()
    assert w.checksums[key] == checksum and writes == [(w.slot(key).offset, w.slot(key).size)]
    piece = os.pread(w._fd, w.slot(key).size, w.slot(key).offset)
    assert xxhash.xxh3_64_intdigest(piece, seed=w.slot(key).seed) == checksum
    with pytest.raises(WriteError):
        w.stream(key, buffered=True).commit(16)  # no reserve before it
    with pytest.raises(WriteError):
        w.stream(key, buffered=True).reserve(w.slot(key).size + 1)  # beyond the slot
    assert w.stream(key).reserve(16) is None  # unbuffered streams have no buffer to fill
    w.abort(remove_part=True)


def test_pieces_in_a_failed_write_never_count(tmp_path):
    w = ColibriWriter(tmp_path / "m.colibri", _model(), dense_dtype=S.DType.F16, expert_format=S.ExpertFormat.INT8_ROW)
    first, second = w.plan.blob_keys()[:2]
    for key in (first, second):
        stream = w.stream(key, buffered=True)
        stream.put(_blob_bytes(w, key, 0))
        stream.finish()
    real = w._write_at

    def failing(data, offset):
        raise WriteError("write failed: No space left on device", field="offset", value=offset)

    w._write_at = failing
    with pytest.raises(WriteError):
        w.flush()
    w._write_at = real
    w.flush()  # nothing left to write, and the pieces of the failed write are not taken for written
    assert first not in w.checksums and second not in w.checksums
    w.abort(remove_part=True)


def test_a_full_buffers_partial_page_goes_out_direct_with_the_next_bytes(tmp_path, monkeypatch):
    """With direct I/O, a buffer that fills up in the middle of a page keeps that partial page for its next block
    when the stream goes on there: contiguous page-aligned pieces make no write through the page cache, whatever
    the chunk sizes; the file and the checksums are those of plain streams."""
    monkeypatch.setattr(writer_mod, "WRITE_BUFFER_BYTES", 3 * 4096)
    w = ColibriWriter(tmp_path / "m.colibri", _model(), dense_dtype=S.DType.F16, expert_format=S.ExpertFormat.INT8_ROW)
    if not w.direct_io:
        w.abort(remove_part=True)
        pytest.skip("no direct I/O on this filesystem")
    buffered = []
    real = writer_mod.pwrite_all
    monkeypatch.setattr(writer_mod, "pwrite_all", lambda fd, data, offset: (
        buffered.append((offset, len(memoryview(data)))) if fd == w._fd else None, real(fd, data, offset)))
    expected = {}
    for i, key in enumerate(w.plan.blob_keys()):
        data = _blob_bytes(w, key, i)
        stream = w.stream(key, buffered=True)
        for a in range(0, len(data), 3000):
            chunk = np.frombuffer(data[a:a + 3000], np.uint8)
            room = stream.reserve(len(chunk))
            assert room is not None
            room[:] = chunk
            stream.commit(len(chunk))
        expected[key] = stream.finish()
    w.flush()
    assert buffered == []
    assert w.checksums == expected
    for i, key in enumerate(w.plan.blob_keys()):
        assert os.pread(w._fd, w.slot(key).size, w.slot(key).offset) == _blob_bytes(w, key, i)
    w.abort(remove_part=True)


def test_allocating_the_data_region_keeps_what_the_part_holds(tmp_path):
    """`allocate_data_region` (direct I/O) allocates the pieces' blocks and changes no byte and not the size: a
    resumed `.part` keeps its pieces."""
    w = ColibriWriter(tmp_path / "m.colibri", _model(), dense_dtype=S.DType.F16, expert_format=S.ExpertFormat.INT8_ROW)
    key = w.plan.blob_keys()[1]
    w.write_expert_blob(*key, _blob_bytes(w, key, 7))
    before = os.pread(w._fd, w.plan.metadata_offset, 0), os.fstat(w._fd).st_size
    w.allocate_data_region()
    assert (os.pread(w._fd, w.plan.metadata_offset, 0), os.fstat(w._fd).st_size) == before
    if w.direct_io:
        assert os.fstat(w._fd).st_blocks * 512 >= w.plan.metadata_offset
    w.abort(remove_part=True)


# --- runs -------------------------------------------------------------------------------------------------------
def test_runs_cut_in_order_by_bytes_or_count():
    sizes = [5, 5, 40, 1, 1, 1, 1, 1, 100, 3]
    got = schedule.runs(list(range(len(sizes))), lambda i: sizes[i], run_bytes=10, run_pieces=3)
    assert got == [[0, 1], [2], [3, 4, 5], [6, 7, 8], [9]]
    assert [x for r in got for x in r] == list(range(len(sizes)))
    assert schedule.runs([], len) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_a_partial_run_hands_on_what_it_finished_then_raises(workers):
    seen = []

    def work(run):
        if run == ["boom"]:
            raise schedule.PartialRun(["done-before-boom"], ValueError("boom"))
        return run

    with pytest.raises(ValueError, match="boom"):
        schedule.run_bounded([["a"], ["boom"], ["b"]], work, workers, seen.append)
    assert ["done-before-boom"] in seen and ["a"] in seen


# --- positional chunk reads -------------------------------------------------------------------------------------
def test_chunks_read_positionally_are_the_mapped_rows(bf16_moe_checkpoint, monkeypatch):
    from colibri_format.convert import rows

    monkeypatch.setattr(rows, "CHUNK_ELEMENTS", 1000)  # several chunks a tensor, rows cut unevenly
    with open_checkpoint(bf16_moe_checkpoint) as src:
        for name in ("model.embed_tokens.weight", "model.layers.1.block_sparse_moe.experts.5.w2.weight",
                     "model.norm.weight"):
            view = src.native_view(name)
            assert src.positional_reader(name, view) is not None
            spans = (RowSpan(name, None, 3 if view.ndim == 2 else 0, view.shape[0]),)
            got = [(row0, chunk.copy()) for _, row0, chunk in iter_span_chunks(src, spans)]
            if view.ndim == 1:
                assert len(got) == 1 and np.array_equal(got[0][1], view)
                continue
            assert len(got) > 1
            for row0, chunk in got:
                assert chunk.dtype == view.dtype and np.array_equal(chunk, view[row0:row0 + chunk.shape[0]])
            assert sum(c.shape[0] for _, c in got) == view.shape[0] - 3
        assert src.positional_reader("model.norm.weight", np.zeros(128, np.uint16)) is None  # not a view of it


def test_a_shard_shrunk_under_the_reader_is_an_error_not_a_crash(bf16_moe_checkpoint, tmp_path):
    import shutil

    copy = Path(shutil.copytree(bf16_moe_checkpoint, tmp_path / "bf16_moe_checkpoint"))
    name = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    with open_checkpoint(copy) as src:
        view = src.native_view(name)
        shard = Path(src.positional_reader(name, view)[0].path)
        os.truncate(shard, os.path.getsize(shard) - 4096)
        with pytest.raises(InvalidInput, match="changed size"):
            for _ in iter_span_chunks(src, (RowSpan(name, None, 0, view.shape[0]),)):
                pass


# --- whole conversions --------------------------------------------------------------------------------------------
# The data region after the header (dense tensors and blobs) and the `quantization` metadata (per-expert errors) of
# `bf16_moe_checkpoint` converted with these options, as xxh3-64 hex digests. The data digests are the bytes the
# converter wrote before issue 20 (tree e94380a; checked again on d2bc2f5, the last tree before the compiled loops);
# the error digests are those of the exact integer error sums (quantize.ERROR_UNITS, which moved the int8 rows'
# means in their ~10th digit; the float16 row's errors did not change).
PINNED = [
    ({}, "b03f68726e35f58d", "6551fda096effbc2"),
    ({"group_size": 32}, "5b42577b3aa43355", "f7e66569c3a97097"),
    ({"quantize": "none", "dtype": "float16"}, "5404c9b6bdfa9afd", "8633b6e02c0f6098"),
    ({"dtype": "float32", "group_size": 16}, "08296bb594380f98", "1f6eaa55819281cf"),
]


def _digests(out: Path) -> tuple[str, str]:
    with colibri_format.open(out) as f:
        end = f.header.metadata_offset
        quantization = json.dumps(f.metadata["quantization"], sort_keys=True)
    with open(out, "rb") as fh:
        data = fh.read(end)[S.HEADER_SIZE:]  # the header holds the metadata's checksum: pinned by the second digest
    return xxhash.xxh3_64_hexdigest(data), xxhash.xxh3_64_hexdigest(quantization.encode())


@pytest.mark.parametrize("options, data, errors", PINNED, ids=["int8-row", "int8-g32", "f16-experts", "f32-g16"])
def test_the_output_is_what_the_converter_wrote_before(bf16_moe_checkpoint, tmp_path, options, data, errors):
    out = tmp_path / "m.colibri"
    convert(bf16_moe_checkpoint, out, **options)
    assert _digests(out) == (data, errors)


@pytest.mark.parametrize("workers, run_bytes, run_pieces, buffer", [
    (1, 1, 1, 4096),                 # a run a piece, a buffer smaller than a blob: direct writes
    (2, 1 << 16, 5, 3 * 4096),       # runs of a few pieces, flushes in the middle of pieces
    (3, 1 << 30, 1000, 1 << 24),     # one run for everything
])
def test_the_same_file_for_any_workers_runs_and_buffer(bf16_moe_checkpoint, tmp_path, monkeypatch, workers, run_bytes,
                                                       run_pieces, buffer):
    monkeypatch.setattr(schedule, "RUN_BYTES", run_bytes)
    monkeypatch.setattr(schedule, "RUN_PIECES", run_pieces)
    monkeypatch.setattr(writer_mod, "WRITE_BUFFER_BYTES", buffer)
    for options, data, errors in PINNED[:2]:
        out = tmp_path / f"m{len(options)}.colibri"
        convert(bf16_moe_checkpoint, out, workers=workers, **options)
        assert _digests(out) == (data, errors)


# --- direct I/O (writer.py: whole pages of write buffers with O_DIRECT, read back through O_DIRECT) ----------------
def _refuse_o_direct(monkeypatch) -> None:
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


@pytest.mark.parametrize("how", ["probed", "refused", "unavailable", "tmpfs"])
def test_direct_and_buffered_writes_give_the_same_file(bf16_moe_checkpoint, tmp_path, monkeypatch, how):
    """Where the filesystem refuses O_DIRECT (EINVAL at the probe) or the platform has none, everything is written
    buffered, and so on tmpfs (which takes O_DIRECT but keeps the file in memory anyway); either way the bytes are
    the pinned ones (with direct I/O, dense tensors at 256-byte offsets cross page boundaries: their partial pages
    go through the page cache, their whole pages direct)."""
    if how == "refused":
        _refuse_o_direct(monkeypatch)
    elif how == "unavailable":
        monkeypatch.setattr(writer_mod, "_O_DIRECT", 0)
    elif how == "tmpfs":
        monkeypatch.setattr(writer_mod, "_filesystem_type", lambda fd: 0x01021994)
    w = ColibriWriter(tmp_path / "probe.colibri", _model(), dense_dtype=S.DType.F16,
                      expert_format=S.ExpertFormat.INT8_ROW)
    direct = w.direct_io
    assert os.pread(w._fd, S.DATA_OFFSET, 0) == bytes(S.DATA_OFFSET)  # the probe leaves the header page zero
    w.abort(remove_part=True)
    if how != "probed":
        assert not direct
    for options, data, errors in PINNED[:3]:
        out = tmp_path / f"m{len(options)}.colibri"
        convert(bf16_moe_checkpoint, out, workers=2, **options)
        assert _digests(out) == (data, errors)


def alter_one_expert_write(monkeypatch) -> dict[str, bool]:
    """Flip one bit of the first expert-region write of more than a page on its way to the file (what a faulty
    device would do); the returned state's "done" says whether it happened."""
    real = ColibriWriter._write_at
    state = {"done": False}

    def altered(self, data, offset):
        data = memoryview(data).cast("B")
        if not state["done"] and len(data) > 4096 and offset >= self.plan.experts_offset:
            state["done"] = True
            data = bytearray(data)
            data[100] ^= 1
        real(self, data, offset)

    monkeypatch.setattr(ColibriWriter, "_write_at", altered)
    return state


def test_a_piece_that_reads_back_wrong_is_refused_before_the_rename(bf16_moe_checkpoint, tmp_path, monkeypatch):
    """One byte of one write altered on its way to the file: the read-back (right after the run with direct I/O,
    at the end otherwise) finds it, and nothing is renamed into place."""
    state = alter_one_expert_write(monkeypatch)
    out = tmp_path / "m.colibri"
    with pytest.raises(WriteError, match="does not read back as written"):
        convert(bf16_moe_checkpoint, out, workers=2, verify=True)
    assert state["done"] and not out.exists()


def test_without_the_read_back_an_altered_write_is_found_by_validate(bf16_moe_checkpoint, tmp_path, monkeypatch):
    """The default (no read-back): the checksums come from the bytes handed to the writes, so a byte the device
    altered on the way is not seen by the conversion, and `validate` (or an engine's first use) names its expert."""
    state = alter_one_expert_write(monkeypatch)
    out = tmp_path / "m.colibri"
    assert convert(bf16_moe_checkpoint, out, workers=2).read_back is False
    report = validate_file(out)
    assert state["done"] and not report.valid
    assert [f.error for f in report.faults] == ["CorruptExpert"], report.faults


def test_an_early_read_back_that_fails_is_done_again_at_the_end(bf16_moe_checkpoint, tmp_path, monkeypatch):
    """A read-back right after a run that fails (here: one that reports a wrong hash) is no verdict: the piece is
    re-read before the rename, and the conversion ends with the pinned file."""
    real = ColibriWriter.read_back_later
    bad = []

    def once_wrong(self, keys):
        real(self, keys)
        if not bad and self._read_backs:
            key, (checksum, future) = next(iter(self._read_backs.items()))
            future.result()
            self._read_backs[key] = (checksum ^ 1, future)
            bad.append(key)

    monkeypatch.setattr(ColibriWriter, "read_back_later", once_wrong)
    out = tmp_path / "m.colibri"
    convert(bf16_moe_checkpoint, out, workers=2, verify=True)
    assert _digests(out) == PINNED[0][1:]


def test_writes_do_not_grow_with_the_number_of_pieces(tmp_path, monkeypatch):
    """Many small experts go out in a few large writes: not one write (or more) per piece."""
    ckpt = tmp_path / "many"
    write_checkpoint(ckpt, mixtral_config(vocab=64, hidden=64, layers=2, experts=64, inter=32, heads=4, kv_heads=2),
                     dtype="bfloat16", shard_bytes=1 << 20)
    calls = []
    real = writer_mod.pwrite_all
    monkeypatch.setattr(writer_mod, "pwrite_all", lambda fd, data, offset: (calls.append(len(memoryview(data))),
                                                                            real(fd, data, offset)))
    convert(ckpt, tmp_path / "m.colibri", workers=2)
    dense = 3 + 2 * 7
    assert len(calls) < dense + 16, len(calls)  # 128 expert blobs among them

"""Property tests of the `.colibri` format (Hypothesis).

* pack/unpack round trips of the three structs;
* random small models written by ColibriWriter and read back identical (every dense dtype, every expert
  format, dense layers, shared experts, tied embeddings);
* truncation at every length of a small file is a ColibriFormatError (TruncatedFile) from `open` and
  `inspect_file`;
* field-targeted mutation (every numeric field of the field tables, set to boundary values, with and
  without re-sealing checksums) and random byte mutations: only ColibriFormatError may escape, from
  `load_tables`, `open` + reading every tensor and expert, `inspect_file` and `validate_file`.

The profile comes from HYPOTHESIS_PROFILE (`ci` when unset: derandomized, 200 examples; `nightly`).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import colibri_format
from colibri_format import errors as E
from colibri_format import spec as S
from colibri_format.dtypes import to_storage
from colibri_format.inspect import inspect_file, validate_file
from colibri_format.reader import load_tables
from colibri_format.spec.checksum import header_checksum
from colibri_format.spec.structs import HEADER_FIELDS
from colibri_format.synthetic import synthetic_metadata, synthetic_model
from colibri_format.writer import ColibriWriter
from tests.spec import craft

PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
pytestmark = pytest.mark.timeout(300)

U16, U32, U64 = (st.integers(0, 2**b - 1) for b in (16, 32, 64))
_INT_STRATEGY = {"H": U16, "I": U32, "Q": U64}


@pytest.fixture(scope="module")
def scratch():
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="colibri-props-", dir=base)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module", params=["int8_row", "int4", "mxfp4"])
def small(request) -> bytes:
    if request.param == "int8_row":
        return bytes(craft.valid_bytes())
    return bytes(craft.valid_bytes(craft.SMALL_4BIT_MODEL, **craft.FOUR_BIT[request.param]))


# --- struct round trips ----------------------------------------------------------------------------------
@st.composite
def headers(draw) -> S.Header:
    values = {}
    for f in HEADER_FIELDS:
        if f.name == "header_checksum":
            continue
        if f.code.endswith("s"):
            values[f.name] = draw(st.binary(min_size=f.size, max_size=f.size))
        else:
            values[f.name] = draw(_INT_STRATEGY[f.code])
    return S.Header(**values)


@PROFILE
@given(headers())
def test_header_round_trip(h: S.Header) -> None:
    raw = h.pack()
    assert len(raw) == S.HEADER_SIZE
    back = S.Header.unpack(raw)
    assert back.header_checksum == header_checksum(raw)
    for f in HEADER_FIELDS[:-1]:
        assert getattr(back, f.name) == getattr(h, f.name), f.name
    assert S.Header.unpack(back.pack()) == back


NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.", min_size=1,
                max_size=S.MAX_NAME_LENGTH)


@PROFILE
@given(NAMES, U16, U32, st.lists(U64, min_size=1, max_size=4), U64, U64, U64)
def test_dense_entry_round_trip(name, dtype, reserved, shape, offset, size, checksum) -> None:
    e = S.DenseEntry(name, dtype, len(shape), reserved, tuple(shape), offset, size, checksum)
    raw = e.pack()
    assert len(raw) == S.DENSE_ENTRY_SIZE
    name_b, d, r, res, *rest = S.DenseEntry.unpack_raw(raw)
    assert name_b.rstrip(b"\0").decode() == name and (d, r, res) == (dtype, len(shape), reserved)
    assert tuple(rest[:len(shape)]) == tuple(shape) and not any(rest[len(shape):4])
    assert tuple(rest[4:]) == (offset, size, checksum)


@PROFILE
@given(U32, U32, U64, U64, U64)
def test_wsit_entry_round_trip(layer, expert, offset, size, checksum) -> None:
    e = S.WsitEntry(layer, expert, offset, size, checksum)
    raw = e.pack()
    assert len(raw) == S.WSIT_ENTRY_SIZE and S.WsitEntry.unpack(raw) == e
    assert struct.unpack("<IIQQQ", raw) == (layer, expert, offset, size, checksum)


# --- write / read back ---------------------------------------------------------------------------------
@st.composite
def models(draw) -> tuple[dict, S.DType, S.ExpertFormat, int]:
    fmt = draw(st.sampled_from(list(S.ExpertFormat)))
    packed = fmt in S.PACKED_FORMATS                      # 4-bit formats: H and I multiples of 32
    hidden = draw(st.sampled_from([32, 64] if packed else [16, 32, 48, 64]))
    heads = draw(st.sampled_from([h for h in (1, 2, 4) if hidden % h == 0]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    layers = draw(st.integers(1, 3))
    dense_layers = tuple(draw(st.sets(st.integers(0, layers - 1), max_size=layers - 1)))
    experts = draw(st.integers(1, 4))
    inter = draw(st.sampled_from([32, 64] if packed else [16, 32, 48]))
    model = synthetic_model(vocab=draw(st.integers(1, 40)), hidden=hidden, layers=layers, heads=heads,
                            kv_heads=kv, experts=experts, top_k=draw(st.integers(1, experts)), expert_inter=inter,
                            dense_layers=dense_layers, shared=draw(st.sampled_from([None, 16, 24])),
                            qk_norm=draw(st.sampled_from(["none", "per_head", "full"])), tie=draw(st.booleans()))
    dense_dtype = draw(st.sampled_from(list(S.DENSE_DTYPES)))
    group = 0
    if fmt == S.ExpertFormat.INT8_GROUP:
        group = draw(st.sampled_from([g for g in (16, 32, 48) if hidden % g == 0 and inter % g == 0]))
    elif fmt == S.ExpertFormat.INT4_GROUP:
        group = draw(st.sampled_from([g for g in S.INT4_GROUP_SIZES if hidden % g == 0 and inter % g == 0]))
    elif fmt == S.ExpertFormat.MXFP4:
        group = S.MXFP4_GROUP_SIZE
    return model, S.DType(dense_dtype), fmt, group


def _random_expert(rng, blob: S.BlobLayout) -> dict[str, np.ndarray]:
    out = {}
    for a in blob.arrays:
        if a.dtype == S.DType.I8:
            out[a.name] = rng.integers(-128, 128, a.shape, dtype=np.int8)
        elif S.DTYPE_SIZE[a.dtype] == 1:                   # packed 4-bit pairs, E8M0 scales: any byte
            out[a.name] = rng.integers(0, 256, a.shape, dtype=np.uint8)
        else:
            out[a.name] = rng.standard_normal(a.shape).astype(np.float32)
    return out


@PROFILE
@given(models(), st.integers(0, 2**32 - 1))
def test_written_model_reads_back_identical(scratch: Path, spec, seed: int) -> None:
    model, dense_dtype, fmt, group = spec
    rng = np.random.default_rng(seed)
    path = scratch / "model.colibri"
    w = ColibriWriter(path, model, dense_dtype=dense_dtype, expert_format=fmt, group_size=group)
    dense, experts = {}, {}
    for t in reversed(w.plan.dense):                       # any order: every offset is planned up front
        dense[t.name] = rng.standard_normal(t.shape).astype(np.float32)
        w.write_dense(t.name, dense[t.name])
    for key in w.plan.blob_keys()[::-1]:
        experts[key] = _random_expert(rng, w.plan.blob)
        w.write_expert(*key, experts[key])
    w.finalize(synthetic_metadata(model, fmt, dense_dtype, group))
    assert validate_file(path).valid
    with colibri_format.open(path, verify="always") as f:
        assert f.model == model
        assert f.dense_names() == [name for name, _ in S.canonical_dense_tensors(model)]
        for name, values in dense.items():
            got = f.dense(name)
            np.testing.assert_array_equal(got, to_storage(values, dense_dtype))
            assert got.dtype == to_storage(values, dense_dtype).dtype
        for (layer, e), arrays in experts.items():
            view = f.expert(layer, e)
            for a in f.blob_layout.arrays:
                np.testing.assert_array_equal(getattr(view, a.name), to_storage(arrays[a.name], a.dtype))
            if fmt not in S.QUANTIZED_FORMATS:
                assert view.gate_up_scale is None and view.down_scale is None
    info = inspect_file(path)
    assert info["header"]["expert_format_name"] == S.EXPERT_FORMAT_NAMES[fmt]
    assert len(info["experts"]["entries"]) == len(model["moe_layers"]) * model["num_experts"]


# --- truncation at every length ----------------------------------------------------------------------------
def test_truncation_at_every_length(scratch: Path) -> None:
    data = craft.valid_bytes(craft.TINY_MODEL)
    path = scratch / "trunc.colibri"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        for length in range(len(data) - 1, -1, -1):     # shrinking keeps the prefix: no rewrite needed
            os.ftruncate(fd, length)
            for call in (colibri_format.open, inspect_file):
                with pytest.raises(E.ColibriFormatError) as info:
                    call(path)
                assert type(info.value) is E.TruncatedFile, (length, info.value)
                assert info.value.field == "file_size"
    finally:
        os.close(fd)


# --- mutations: only ColibriFormatError escapes ------------------------------------------------------------
def _exercise(path: Path, *, expect_invalid: bool) -> None:
    """Every entry point a user has; anything but ColibriFormatError propagates and fails the test."""
    try:
        load_tables(path)
    except E.ColibriFormatError:
        pass
    try:
        with colibri_format.open(path) as f:
            for name in f.dense_names():
                try:
                    f.dense_f32(name)
                except E.CorruptTensor:
                    pass
            for layer in f.tables.plan.moe_layers:
                for e in range(f.header.num_experts):
                    try:
                        f.expert_f32(layer, e)
                    except E.CorruptExpert:
                        pass
    except E.ColibriFormatError:
        pass
    try:
        inspect_file(path)
    except E.ColibriFormatError:
        pass
    report = validate_file(path)
    assert report.faults or report.valid
    if expect_invalid:
        assert not report.valid


FIELDS = craft.numeric_fields()


@PROFILE
@given(st.sampled_from(FIELDS), st.integers(0, 8), st.integers(0, 7), st.booleans())
def test_field_boundary_values(scratch: Path, small: bytes, field, index: int, which: int, fix: bool) -> None:
    table, name = field
    buf = bytearray(small)
    h = craft.header_of(buf)
    count = {"header": 1, "dense": h.num_dense_tensors, "wsit": h.num_blobs}[table]
    size = craft.field_range(table, name)[1] if name != "shape" else 8
    values = craft.boundary_values(len(buf), size)
    craft.set_field_value(buf, table, index % count, name, values[which % len(values)], fix=fix)
    path = scratch / "field.colibri"
    path.write_bytes(buf)
    _exercise(path, expect_invalid=not fix and bytes(buf) != small)


@PROFILE
@given(st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=8), st.booleans())
def test_random_byte_mutations(scratch: Path, small: bytes, edits, fix: bool) -> None:
    buf = bytearray(small)
    for pos, value in edits:
        buf[pos % len(buf)] = value
    if fix:
        craft.fix_section_checksums(buf)
    path = scratch / "bytes.colibri"
    path.write_bytes(buf)
    _exercise(path, expect_invalid=not fix and bytes(buf) != small)


@PROFILE
@given(st.integers(0, 2**31), st.integers(1, 2**31), st.booleans())
def test_splices(scratch: Path, small: bytes, a: int, b: int, fix: bool) -> None:
    """A chunk of the file copied over another place (a misplaced write), possibly re-sealed."""
    buf = bytearray(small)
    src, dst = a % len(buf), b % len(buf)
    n = min(1 + (a ^ b) % 512, len(buf) - max(src, dst))
    assume(n > 0)
    buf[dst:dst + n] = small[src:src + n]
    if fix:
        craft.fix_section_checksums(buf)
    path = scratch / "splice.colibri"
    path.write_bytes(buf)
    _exercise(path, expect_invalid=not fix and bytes(buf) != small)


def test_every_field_every_boundary_value(scratch: Path, small: bytes) -> None:
    """The exhaustive version of the property above: each numeric field of the first and the last entry,
    each boundary value, sealed and unsealed."""
    h = craft.header_of(small)
    path = scratch / "exhaustive.colibri"
    tried = 0
    for table, name in FIELDS:
        count = {"header": 1, "dense": h.num_dense_tensors, "wsit": h.num_blobs}[table]
        size = craft.field_range(table, name)[1] if name != "shape" else 8
        for index in sorted({0, count - 1}):
            for value in craft.boundary_values(len(small), size):
                for fix in (False, True):
                    buf = craft.set_field_value(bytearray(small), table, index, name, value, fix=fix)
                    path.write_bytes(buf)
                    _exercise(path, expect_invalid=not fix and bytes(buf) != small)
                    tried += 1
    assert tried > 500

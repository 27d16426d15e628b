"""Structural checks of a `.colibri` file: header, directory, WSIT and layout, before any data is used.

Every number taken from the file is checked against a named limit and against the bytes really there,
with Python integers (no wrap-around), before it is used to size or locate anything.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from .. import errors as E
from . import constants as C
from .checksum import dense_seed, digest, expert_seed, header_checksum, section_seed
from .layout import BlobLayout, FilePlan, blob_layout, plan_file
from .structs import (DENSE_ENTRY_FIELD_OFFSETS, HEADER_FIELD_OFFSETS, WSIT_ENTRY_FIELD_OFFSETS, DenseEntry,
                      Header, WSIT_ENTRY_FMT)

NAME_RE = re.compile(r"[A-Za-z0-9_.]{1,127}")
WSIT_DTYPE = np.dtype({"names": ["layer", "expert", "offset", "size", "checksum"],
                       "formats": ["<u4", "<u4", "<u8", "<u8", "<u8"],
                       "offsets": [0, 4, 8, 16, 24], "itemsize": C.WSIT_ENTRY_SIZE})
assert WSIT_DTYPE.itemsize == struct.calcsize(WSIT_ENTRY_FMT)


def _hoff(name: str) -> int:
    return HEADER_FIELD_OFFSETS[name][0]


def _bad(field: str, value, why: str, exc=E.InvalidHeaderField):
    raise exc(why, field=field, value=value, offset=_hoff(field))


def parse_header(buf: bytes, file_size: int) -> Header:
    """Decode and check the 512-byte header: magic, version, checksum, reserved bytes, then fields."""
    if file_size < C.HEADER_SIZE or len(buf) < C.HEADER_SIZE:
        raise E.TruncatedFile("file is shorter than the 512-byte header", field="file_size",
                              value=file_size, offset=0)
    if buf[: len(C.MAGIC)] != C.MAGIC or any(buf[len(C.MAGIC): C.MAGIC_FIELD_SIZE]):
        raise E.BadMagic("not a .colibri file (bad magic)", field="magic",
                         value=bytes(buf[: C.MAGIC_FIELD_SIZE]), offset=0)
    major, minor = struct.unpack_from("<HH", buf, _hoff("version_major"))
    if major != C.VERSION_MAJOR:
        hint = " (byte-swapped: big-endian file?)" if major == C.VERSION_MAJOR << 8 else ""
        _bad("version_major", major, f"unsupported major version{hint}; this reader implements "
             f"{C.VERSION_MAJOR}.x", E.UnsupportedVersion)
    stored = struct.unpack_from("<Q", buf, _hoff("header_checksum"))[0]
    if header_checksum(buf) != stored:
        raise E.CorruptHeader("header checksum mismatch", field="header_checksum", value=stored,
                              offset=_hoff("header_checksum"))
    h = Header.unpack(bytes(buf[: C.HEADER_SIZE]))
    _check_header_fields(h, file_size)
    return h


def _check_header_fields(h: Header, file_size: int) -> None:
    if h.flags != 0:
        _bad("flags", h.flags, "no flag is defined in v1", E.CorruptHeader)
    if h.reserved0 != 0:
        _bad("reserved0", h.reserved0, "reserved field must be zero", E.CorruptHeader)
    if any(h.reserved):
        _bad("reserved", "non-zero", "reserved bytes must be zero", E.CorruptHeader)
    if h.file_size != file_size:
        exc = E.TruncatedFile if file_size < h.file_size else E.SizeMismatch
        _bad("file_size", h.file_size, f"declared size differs from the real size {file_size}", exc)
    limits = {"alignment": (C.BLOB_ALIGNMENT, C.BLOB_ALIGNMENT), "num_layers": (1, C.MAX_LAYERS),
              "num_moe_layers": (1, h.num_layers), "num_experts": (1, C.MAX_EXPERTS),
              "top_k": (1, min(h.num_experts, C.MAX_TOP_K)), "num_dense_tensors": (1, C.MAX_DENSE_TENSORS),
              "hidden_size": (C.DIM_MULTIPLE, C.MAX_HIDDEN),
              "expert_intermediate_size": (C.DIM_MULTIPLE, C.MAX_EXPERT_INTERMEDIATE),
              "data_offset": (C.DATA_OFFSET, C.DATA_OFFSET)}
    for name, (lo, hi) in limits.items():
        value = getattr(h, name)
        if not lo <= value <= hi:
            _bad(name, value, f"must be in [{lo}, {hi}]")
    _check_expert_format(h)
    for name in ("hidden_size", "expert_intermediate_size"):
        if getattr(h, name) % C.DIM_MULTIPLE:
            _bad(name, getattr(h, name), f"must be a multiple of {C.DIM_MULTIPLE}")
    if h.num_blobs > C.MAX_WSIT_ENTRIES:
        _bad("num_experts", h.num_experts, f"num_moe_layers*num_experts exceeds {C.MAX_WSIT_ENTRIES}")
    _check_group(h)
    _check_section_sizes(h)


def _check_expert_format(h: Header) -> None:
    """A code this reader defines, and one the file's minor version defines (a 1.0 file cannot hold int4)."""
    code, known = h.expert_format, {int(f) for f in C.ExpertFormat}
    if code not in known:
        if h.version_minor > C.VERSION_MINOR:
            _bad("expert_format", code, f"unknown expert format; the file is version {h.version_major}."
                 f"{h.version_minor} and this reader implements {C.VERSION_MAJOR}.{C.VERSION_MINOR} (codes 0.."
                 f"{max(known)}): a newer reader is needed", E.UnsupportedVersion)
        _bad("expert_format", code, f"must be in [0, {max(known)}]")
    fmt = C.ExpertFormat(code)
    need = C.MINOR_VERSION_OF[fmt]
    if h.version_minor < need:
        _bad("version_minor", h.version_minor, f"expert_format {C.EXPERT_FORMAT_NAMES[fmt]} ({code}) is defined "
             f"from version {C.VERSION_MAJOR}.{need}; the header declares {h.version_major}.{h.version_minor}")


def group_rule(fmt: C.ExpertFormat, group: int, hidden: int, inter: int) -> str | None:
    """Why `group` is not a valid group_size for expert format `fmt` with these H and I, or None when it is."""
    if fmt not in C.GROUPED_FORMATS:
        return None if group == 0 else f"must be 0 unless expert_format is one of " \
            f"{', '.join(C.EXPERT_FORMAT_NAMES[f] for f in sorted(C.GROUPED_FORMATS))}"
    if fmt == C.ExpertFormat.INT8_GROUP:
        ok = group >= C.MIN_GROUP_SIZE and group % C.DIM_MULTIPLE == 0
        what = "a multiple of 16"
    elif fmt == C.ExpertFormat.INT4_GROUP:
        ok, what = group in C.INT4_GROUP_SIZES, "32, 64 or 128"
    else:
        ok, what = group == C.MXFP4_GROUP_SIZE, str(C.MXFP4_GROUP_SIZE)
    if ok and hidden % group == 0 and inter % group == 0:
        return None
    return f"{C.EXPERT_FORMAT_NAMES[fmt]} needs {what} dividing hidden_size {hidden} and " \
           f"expert_intermediate_size {inter}"


def _check_group(h: Header) -> None:
    why = group_rule(C.ExpertFormat(h.expert_format), h.group_size, h.hidden_size, h.expert_intermediate_size)
    if why is not None:
        _bad("group_size", h.group_size, why)


def _check_section_sizes(h: Header) -> None:
    if not 2 <= h.metadata_size <= C.MAX_METADATA_BYTES:
        _bad("metadata_size", h.metadata_size, f"must be in [2, {C.MAX_METADATA_BYTES}]")
    if h.dense_dir_size != h.num_dense_tensors * C.DENSE_ENTRY_SIZE:
        _bad("dense_dir_size", h.dense_dir_size, "must equal num_dense_tensors * 192")
    if h.wsit_size != h.num_blobs * C.WSIT_ENTRY_SIZE:
        _bad("wsit_size", h.wsit_size, "must equal num_moe_layers * num_experts * 32")
    blob = header_blob_layout(h)
    if h.expert_blob_size != blob.size:
        _bad("expert_blob_size", h.expert_blob_size, f"the blob layout implies {blob.size}")
    # Sections: metadata right after the blobs, then the directory, then the WSIT ending the file.
    experts_end = h.experts_offset + h.num_blobs * h.expert_blob_size
    if h.experts_offset % C.BLOB_ALIGNMENT or not C.DATA_OFFSET <= h.experts_offset <= h.file_size:
        _bad("experts_offset", h.experts_offset, "must be 4096-aligned and inside the file", E.LayoutError)
    if h.metadata_offset != experts_end:
        _bad("metadata_offset", h.metadata_offset, f"must follow the last blob at {experts_end}", E.LayoutError)
    dir_offset = (h.metadata_offset + h.metadata_size + C.SECTION_ALIGNMENT - 1) // C.SECTION_ALIGNMENT \
        * C.SECTION_ALIGNMENT
    if h.dense_dir_offset != dir_offset:
        _bad("dense_dir_offset", h.dense_dir_offset, f"must be {dir_offset}", E.LayoutError)
    if h.wsit_offset != h.dense_dir_offset + h.dense_dir_size:
        _bad("wsit_offset", h.wsit_offset, "must follow the dense directory", E.LayoutError)
    if h.wsit_offset + h.wsit_size != h.file_size:
        _bad("wsit_size", h.wsit_size, "the WSIT must end exactly at the end of the file", E.LayoutError)


def header_blob_layout(h: Header) -> BlobLayout:
    return blob_layout(h.hidden_size, h.expert_intermediate_size, C.ExpertFormat(h.expert_format), h.group_size)


def check_section(h: Header, section: C.Section, raw) -> None:
    name = {C.Section.METADATA: "metadata", C.Section.DENSE_DIRECTORY: "dense_dir", C.Section.WSIT: "wsit"}[section]
    offset, stored = getattr(h, f"{name}_offset"), getattr(h, f"{name}_checksum")
    if digest(raw, section_seed(section, offset)) != stored:
        raise E.CorruptSection(f"{name} section checksum mismatch", field=f"{name}_checksum", value=stored,
                               offset=offset)


def parse_dense_directory(h: Header, raw: bytes) -> list[DenseEntry]:
    """Decode and check every directory entry (name, dtype, rank, shape, size), in file order."""
    entries, seen = [], set()
    for k in range(h.num_dense_tensors):
        base = h.dense_dir_offset + k * C.DENSE_ENTRY_SIZE
        fields = DenseEntry.unpack_raw(raw[k * C.DENSE_ENTRY_SIZE:(k + 1) * C.DENSE_ENTRY_SIZE])
        name_b, dtype, rank, reserved, *dims = fields[:8]
        offset, size, checksum = fields[8:]

        def bad(field, value, why):
            raise E.InvalidDirectoryEntry(f"dense entry {k}: {why}", field=f"dense[{k}].{field}", value=value,
                                          offset=base + DENSE_ENTRY_FIELD_OFFSETS[field][0])
        name = _entry_name(name_b, bad)
        if name in seen:
            bad("name", name, "duplicate tensor name")
        seen.add(name)
        if dtype not in {int(d) for d in C.DENSE_DTYPES}:
            bad("dtype", dtype, "unknown or non-dense dtype code")
        if not 1 <= rank <= C.MAX_RANK:
            bad("rank", rank, f"rank must be 1..{C.MAX_RANK}")
        if reserved:
            bad("reserved", reserved, "must be zero")
        if any(not 1 <= d <= C.MAX_DIM for d in dims[:rank]) or any(dims[rank:]):
            bad("shape", tuple(dims), "used dims must be 1..2^24 and unused dims 0")
        shape = tuple(dims[:rank])
        expected = C.DTYPE_SIZE[C.DType(dtype)]
        for d in shape:
            expected *= d
        if size != expected:
            bad("size", size, f"shape and dtype imply {expected} bytes")
        entries.append(DenseEntry(name, dtype, rank, 0, shape, offset, size, checksum))
    return entries


def _entry_name(name_b: bytes, bad) -> str:
    stripped = name_b.rstrip(b"\0")
    if b"\0" in stripped or not stripped:
        bad("name", name_b[:32], "name must be non-empty and NUL-padded")
    try:
        name = stripped.decode("ascii")
    except UnicodeDecodeError:
        bad("name", stripped[:32], "name must be ASCII [A-Za-z0-9_.]")
    if not NAME_RE.fullmatch(name):
        bad("name", name, "name must match [A-Za-z0-9_.]{1,127}")
    return name


def parse_wsit(h: Header, raw: bytes) -> np.ndarray:
    """Decode the WSIT into a structured array (a copy, so the file mapping can close)."""
    return np.frombuffer(raw, dtype=WSIT_DTYPE, count=h.num_blobs).copy()


def check_layout(h: Header, entries: list[DenseEntry], wsit: np.ndarray) -> FilePlan:
    """Demand the canonical layout: every tensor and blob exactly where the plan puts it."""
    layers = wsit["layer"][:: h.num_experts].tolist()
    plan = plan_file([(e.name, C.DType(e.dtype), e.shape) for e in entries], tuple(layers), h.num_experts,
                     header_blob_layout(h))
    for k, (entry, planned) in enumerate(zip(entries, plan.dense)):
        if entry.offset != planned.offset:
            raise E.LayoutError(f"dense tensor {entry.name!r} is not at its planned offset {planned.offset}",
                                field=f"dense[{k}].offset", value=entry.offset,
                                offset=h.dense_dir_offset + k * C.DENSE_ENTRY_SIZE + DENSE_ENTRY_FIELD_OFFSETS["offset"][0])
    if plan.experts_offset != h.experts_offset:
        _bad("experts_offset", h.experts_offset, f"the dense tensors end at {plan.experts_offset}", E.LayoutError)
    _check_wsit_entries(h, wsit, plan)
    return plan


class Region(NamedTuple):
    """Bytes [start, start + size) of a file, as one table entry or header field records them (`check_disjoint`)."""

    what: str          # for the message: "expert (0, 3)", "dense tensor 'model.norm.weight'", "the WSIT"
    start: int
    size: int
    field: str         # the field that records `start`: "wsit[3].offset", "dense[0].offset", "metadata_offset"
    at: int | None     # where that field lies in the file (None: not placed yet)


def check_disjoint(regions: Iterable[Region], file_size: int, within: str = "the file") -> None:
    """Every region lies within [0, file_size) (`within` names that range) and no two share a byte: sorted by start,
    one pass that keeps the furthest end seen so far. A LayoutError names the offending region's field, its start
    and where the field lies. Independent of `plan_file` on purpose: the writer checks its own plan with it
    (writer.py)."""
    furthest: Region | None = None
    for r in sorted((r for r in regions if r.size), key=lambda r: r.start):
        end = r.start + r.size
        if r.start < 0 or r.size < 0 or end > file_size:
            raise E.LayoutError(f"{r.what} at [{r.start}, {end}) does not lie within {within} [0, {file_size})",
                                field=r.field, value=r.start, offset=r.at)
        if furthest is not None and r.start < furthest.start + furthest.size:
            raise E.LayoutError(f"{r.what} at [{r.start}, {end}) overlaps {furthest.what} at "
                                f"[{furthest.start}, {furthest.start + furthest.size})", field=r.field, value=r.start,
                                offset=r.at)
        if furthest is None or end > furthest.start + furthest.size:
            furthest = r


def _check_wsit_entries(h: Header, wsit: np.ndarray, plan: FilePlan) -> None:
    n_moe, n_exp = h.num_moe_layers, h.num_experts
    layers = wsit["layer"].reshape(n_moe, n_exp)
    experts = wsit["expert"].reshape(n_moe, n_exp)
    index = np.arange(h.num_blobs, dtype=np.uint64)
    checks = [
        ("layer", (layers == layers[:, :1]).ravel(), "layer must be constant within a layer's run"),
        ("layer", _increasing(layers[:, 0], h.num_layers).repeat(n_exp), "layers must increase and be < num_layers"),
        ("expert", (experts == np.arange(n_exp, dtype=np.uint32)).ravel(), "experts must be in canonical order"),
        ("offset", wsit["offset"] == np.uint64(h.experts_offset) + index * np.uint64(h.expert_blob_size),
         "blob is not at its planned offset"),
        ("size", wsit["size"] == np.uint64(h.expert_blob_size), "blob size differs from expert_blob_size"),
    ]
    for field, ok, why in checks:
        bad = np.flatnonzero(~ok)
        if bad.size:
            k = int(bad[0])
            raise E.InvalidDirectoryEntry(f"WSIT entry {k}: {why}", field=f"wsit[{k}].{field}",
                                          value=int(wsit[field][k]),
                                          offset=h.wsit_offset + k * C.WSIT_ENTRY_SIZE + WSIT_ENTRY_FIELD_OFFSETS[field][0])


def _increasing(first_layers: np.ndarray, num_layers: int) -> np.ndarray:
    ok = first_layers < num_layers
    ok[1:] &= first_layers[1:] > first_layers[:-1]
    return ok


def check_metadata_agrees(h: Header, meta: dict, entries: list[DenseEntry], plan: FilePlan) -> None:
    """The metadata, the header and the directory must describe the same model."""
    from .tensors import canonical_dense_tensors
    model, quant = meta["model"], meta["quantization"]
    pairs = {"num_layers": h.num_layers, "num_experts": h.num_experts, "top_k": h.top_k,
             "hidden_size": h.hidden_size, "expert_intermediate_size": h.expert_intermediate_size}
    for key, value in pairs.items():
        if model[key] != value:
            raise E.InvalidMetadata(f"metadata model.{key} disagrees with the header ({value})",
                                    field=f"model.{key}", value=model[key], offset=h.metadata_offset)
    if tuple(model["moe_layers"]) != plan.moe_layers:
        raise E.InvalidMetadata("metadata moe_layers disagree with the WSIT layers", field="model.moe_layers",
                                value=model["moe_layers"], offset=h.metadata_offset)
    fmt_name = C.EXPERT_FORMAT_NAMES[C.ExpertFormat(h.expert_format)]
    if quant["experts"] != fmt_name:
        raise E.InvalidMetadata(f"quantization.experts disagrees with the header ({fmt_name})",
                                field="quantization.experts", value=quant["experts"], offset=h.metadata_offset)
    if (quant.get("group_size") or None) != (h.group_size or None):   # null (or 0) exactly when the header has none
        raise E.InvalidMetadata("quantization.group_size disagrees with the header", field="quantization.group_size",
                                value=quant.get("group_size"), offset=h.metadata_offset)
    dense_dtype = C.DTYPE_NAMES[quant["dense_dtype"]]
    expected = canonical_dense_tensors(model)
    got = [(e.name, e.shape) for e in entries]
    if got != expected:
        first = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise E.InvalidDirectoryEntry(
            f"dense directory differs from the tensors the model needs at entry {first} "
            f"(expected {expected[first] if first < len(expected) else 'end'})", field=f"dense[{first}]",
            value=got[first] if first < len(got) else None, offset=h.dense_dir_offset + first * C.DENSE_ENTRY_SIZE)
    for k, e in enumerate(entries):
        if e.dtype != dense_dtype:
            raise E.InvalidDirectoryEntry("dense tensor dtype differs from quantization.dense_dtype",
                                          field=f"dense[{k}].dtype", value=e.dtype,
                                          offset=h.dense_dir_offset + k * C.DENSE_ENTRY_SIZE + 128)


def dense_fault(view, entry: DenseEntry) -> E.CorruptTensor | None:
    """The error for a dense tensor whose bytes (in the mapped `view` of the file) fail their checksum."""
    if digest(view[entry.offset:entry.offset + entry.size], dense_seed(entry.name, entry.offset)) == entry.checksum:
        return None
    return E.CorruptTensor(f"dense tensor {entry.name!r} fails its checksum", field=entry.name, offset=entry.offset)


def expert_fault(view, layer: int, expert: int, offset: int, size: int, checksum: int) -> E.CorruptExpert | None:
    """The error for an expert blob whose bytes fail their (layer, expert, offset)-seeded checksum."""
    if digest(view[offset:offset + size], expert_seed(layer, expert, offset)) == checksum:
        return None
    return E.CorruptExpert(f"expert {expert} of layer {layer} fails its checksum", field=f"expert[{layer},{expert}]",
                           offset=offset)

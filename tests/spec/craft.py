"""Helpers that build deliberately broken `.colibri` files from valid ones.

Every patch goes through the field tables of `colibri_format.spec.structs`, so a field moving in the spec
moves here too. By default a patch re-seals what covers the patched bytes (the header checksum, and the
section checksum of a directory or WSIT entry), so the check under test is the one that fires, not the
checksum in front of it. Pass `fix=False` to leave the seals alone.

Used by tests/spec, tests/conformance/make_corpus.py and tests/fuzz/fuzz_format.py.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

from colibri_format import spec as S
from colibri_format.spec.checksum import dense_seed, digest, expert_seed, header_checksum, section_seed
from colibri_format.spec.structs import (DENSE_ENTRY_FIELD_OFFSETS, DENSE_ENTRY_FIELDS, HEADER_CHECKED_SIZE,
                                         HEADER_FIELD_OFFSETS, HEADER_FIELDS, WSIT_ENTRY_FIELD_OFFSETS,
                                         WSIT_ENTRY_FIELDS)
from colibri_format.synthetic import synthetic_model, write_synthetic

_CODES = {
    "header": {f.name: f.code for f in HEADER_FIELDS},
    "dense": {f.name: f.code for f in DENSE_ENTRY_FIELDS},
    "wsit": {f.name: f.code for f in WSIT_ENTRY_FIELDS},
}
_OFFSETS = {"header": HEADER_FIELD_OFFSETS, "dense": DENSE_ENTRY_FIELD_OFFSETS, "wsit": WSIT_ENTRY_FIELD_OFFSETS}

# The smallest model the format allows that still has every piece (dense tensors, a blob, all sections).
TINY_MODEL = dict(vocab=16, hidden=16, layers=1, heads=2, kv_heads=1, experts=1, top_k=1, expert_inter=16,
                  tie=True)
SMALL_MODEL = dict(vocab=16, hidden=16, layers=1, heads=2, kv_heads=1, experts=2, top_k=1, expert_inter=16,
                   tie=True)
# The 4-bit formats (v1.1) need H and I to be multiples of 32.
SMALL_4BIT_MODEL = dict(SMALL_MODEL, hidden=32, expert_inter=32)
TINY_4BIT_MODEL = dict(TINY_MODEL, hidden=32, expert_inter=32)
FOUR_BIT = {"int4": dict(expert_format=S.ExpertFormat.INT4_GROUP, group_size=32),
            "mxfp4": dict(expert_format=S.ExpertFormat.MXFP4, group_size=32)}


# --- building valid files ------------------------------------------------------------------------------
def valid_bytes(model_kwargs: dict | None = None, **write_kwargs) -> bytearray:
    """Bytes of a valid synthetic file (written to a private temp dir and read back)."""
    model = synthetic_model(**(SMALL_MODEL if model_kwargs is None else model_kwargs))
    write_kwargs.setdefault("dense_dtype", S.DType.F16)
    with tempfile.TemporaryDirectory() as d:
        path = write_synthetic(Path(d) / "v.colibri", model, **write_kwargs)
        return bytearray(Path(path).read_bytes())


def write(path: str | os.PathLike, buf) -> str:
    Path(path).write_bytes(bytes(buf))
    return str(path)


# --- generic field patching ----------------------------------------------------------------------------
def field_range(table: str, name: str) -> tuple[int, int]:
    """(offset, size) of a field inside its struct; table is 'header', 'dense' or 'wsit'."""
    return _OFFSETS[table][name]


def pack_field(buf: bytearray, table: str, base: int, name: str, value) -> None:
    """Write `value` into field `name` of the struct starting at `base` (little-endian, its own width)."""
    off, size = _OFFSETS[table][name]
    code = _CODES[table][name]
    if code == "4Q":
        dims = tuple(value) + (0,) * (4 - len(tuple(value)))
        struct.pack_into("<4Q", buf, base + off, *dims)
    elif code.endswith("s"):
        raw = bytes(value)[:size]
        buf[base + off: base + off + size] = raw + bytes(size - len(raw))
    else:
        struct.pack_into("<" + code, buf, base + off, value)


def header_of(buf) -> S.Header:
    return S.Header.unpack(bytes(buf[:S.HEADER_SIZE]))


def fix_header_checksum(buf: bytearray) -> None:
    struct.pack_into("<Q", buf, HEADER_CHECKED_SIZE, header_checksum(bytes(buf[:S.HEADER_SIZE])))


def _section_checksum(buf, section: S.Section, offset: int, size: int) -> int | None:
    if offset + size > len(buf):
        return None
    return digest(bytes(buf[offset:offset + size]), section_seed(section, offset))


def fix_section_checksums(buf: bytearray) -> None:
    """Recompute the three section checksums from the header's (possibly patched) offsets, then the header's."""
    h = header_of(buf)
    for section, name in ((S.Section.METADATA, "metadata"), (S.Section.DENSE_DIRECTORY, "dense_dir"),
                          (S.Section.WSIT, "wsit")):
        value = _section_checksum(buf, section, getattr(h, f"{name}_offset"), getattr(h, f"{name}_size"))
        if value is not None:
            pack_field(buf, "header", 0, f"{name}_checksum", value)
    fix_header_checksum(buf)


def patch_header(buf: bytearray, *, fix: bool = True, **fields) -> bytearray:
    """Set header fields; with `fix`, recompute the header checksum so the field check itself is reached."""
    for name, value in fields.items():
        pack_field(buf, "header", 0, name, value)
    if fix:
        fix_header_checksum(buf)
    return buf


def dense_entry_base(buf, k: int) -> int:
    return header_of(buf).dense_dir_offset + k * S.DENSE_ENTRY_SIZE


def wsit_entry_base(buf, k: int) -> int:
    return header_of(buf).wsit_offset + k * S.WSIT_ENTRY_SIZE


def patch_dense_entry(buf: bytearray, k: int, *, fix: bool = True, **fields) -> bytearray:
    """Set fields of dense directory entry k; with `fix`, re-seal the directory and the header."""
    base = dense_entry_base(buf, k)
    for name, value in fields.items():
        pack_field(buf, "dense", base, name, value)
    if fix:
        fix_section_checksums(buf)
    return buf


def patch_wsit_entry(buf: bytearray, k: int, *, fix: bool = True, **fields) -> bytearray:
    """Set fields of WSIT entry k; with `fix`, re-seal the WSIT and the header."""
    base = wsit_entry_base(buf, k)
    for name, value in fields.items():
        pack_field(buf, "wsit", base, name, value)
    if fix:
        fix_section_checksums(buf)
    return buf


def read_dense_entry(buf, k: int) -> dict:
    base = dense_entry_base(buf, k)
    raw = S.DenseEntry.unpack_raw(bytes(buf[base:base + S.DENSE_ENTRY_SIZE]))
    name, dtype, rank, reserved, *rest = raw
    return {"name": name.rstrip(b"\0").decode(), "dtype": dtype, "rank": rank, "reserved": reserved,
            "shape": tuple(rest[:4]), "offset": rest[4], "size": rest[5], "checksum": rest[6]}


def read_wsit_entry(buf, k: int) -> dict:
    base = wsit_entry_base(buf, k)
    e = S.WsitEntry.unpack(bytes(buf[base:base + S.WSIT_ENTRY_SIZE]))
    return {"layer": e.layer, "expert": e.expert, "offset": e.offset, "size": e.size, "checksum": e.checksum}


def fix_dense_checksum(buf: bytearray, k: int) -> bytearray:
    """After changing a dense tensor's bytes: store their new checksum (and re-seal the directory)."""
    e = read_dense_entry(buf, k)
    value = digest(bytes(buf[e["offset"]:e["offset"] + e["size"]]), dense_seed(e["name"], e["offset"]))
    return patch_dense_entry(buf, k, checksum=value)


def fix_expert_checksum(buf: bytearray, k: int) -> bytearray:
    """After changing blob k's bytes: store its new seeded checksum (and re-seal the WSIT)."""
    e = read_wsit_entry(buf, k)
    value = digest(bytes(buf[e["offset"]:e["offset"] + e["size"]]), expert_seed(e["layer"], e["expert"], e["offset"]))
    return patch_wsit_entry(buf, k, checksum=value)


def metadata_bytes(buf) -> bytes:
    h = header_of(buf)
    return bytes(buf[h.metadata_offset:h.metadata_offset + h.metadata_size])


def rewrite_metadata(buf, raw: bytes) -> bytearray:
    """A new file whose metadata section is `raw` (any bytes), everything after it moved and re-sealed.

    The directory and WSIT hold no offsets into the tail, so they move unchanged; the header's section
    offsets, sizes, checksums and file size are recomputed exactly as the writer plans them.
    """
    h = header_of(buf)
    directory = bytes(buf[h.dense_dir_offset:h.dense_dir_offset + h.dense_dir_size])
    wsit = bytes(buf[h.wsit_offset:h.wsit_offset + h.wsit_size])
    out = bytearray(buf[:h.metadata_offset]) + raw
    dir_offset = S.align_up(len(out), S.SECTION_ALIGNMENT)
    out += bytes(dir_offset - len(out)) + directory
    wsit_offset = len(out)
    out += wsit
    patch_header(out, fix=False, metadata_size=len(raw), dense_dir_offset=dir_offset, wsit_offset=wsit_offset,
                 file_size=len(out))
    fix_section_checksums(out)
    return out


def boundary_values(file_len: int, size: int) -> list[int]:
    """The boundary values of the test plan, reduced to what a field of `size` bytes can hold."""
    mask = (1 << (8 * size)) - 1
    raw = [0, 1, 2**31 - 1, 2**32 - 1, 2**63, 2**64 - 1, file_len, file_len + 1]
    return sorted({v & mask for v in raw})


def numeric_fields() -> list[tuple[str, str]]:
    """(table, field) of every integer field (not the byte strings), for field-targeted mutation."""
    out = []
    for table, fields in (("header", HEADER_FIELDS), ("dense", DENSE_ENTRY_FIELDS), ("wsit", WSIT_ENTRY_FIELDS)):
        out += [(table, f.name) for f in fields if not f.code.endswith("s")]
    return out


def field_base(buf, table: str, index: int = 0) -> int:
    if table == "header":
        return 0
    return dense_entry_base(buf, index) if table == "dense" else wsit_entry_base(buf, index)


def set_field_value(buf: bytearray, table: str, index: int, name: str, value: int, *, fix: bool) -> bytearray:
    """Set a numeric field (any table) to `value` modulo its width; `fix` re-seals sections and header."""
    off, size = _OFFSETS[table][name]
    base = field_base(buf, table, index)
    if base + off + size > len(buf):
        return buf
    if _CODES[table][name] == "4Q":
        struct.pack_into("<Q", buf, base + off, value & (2**64 - 1))     # the first dimension
    else:
        pack_field(buf, table, base, name, value & ((1 << (8 * size)) - 1))
    if fix:
        if table == "header":
            fix_header_checksum(buf)
        else:
            fix_section_checksums(buf)
    return buf

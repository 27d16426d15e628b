"""Binary structs of the `.colibri` v1 format: each struct format is built from its field table.

The field tables (name, struct code, meaning) are the single source of truth: the struct format, the
byte offsets shown by `colibri inspect`, the fuzzers' field map and the tables in docs/spec.md all come
from them (tests/spec/test_spec_doc.py keeps the document in step).
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass, fields
from typing import ClassVar

from . import constants as C
from .checksum import header_checksum


@dataclass(frozen=True)
class Field:
    name: str
    code: str        # struct code, little-endian implied
    doc: str

    @property
    def size(self) -> int:
        return struct.calcsize("<" + self.code)


def field_offsets(table: tuple[Field, ...]) -> dict[str, tuple[int, int]]:
    """Map field name -> (offset, size) within its struct."""
    out, pos = {}, 0
    for f in table:
        out[f.name] = (pos, f.size)
        pos += f.size
    return out


def _fmt(table: tuple[Field, ...]) -> str:
    return "<" + "".join(f.code for f in table)


HEADER_FIELDS: tuple[Field, ...] = (
    Field("magic", "16s", "`COLIBRIv1` followed by 7 NUL bytes"),
    Field("version_major", "H", "1; a reader MUST reject any other major version"),
    Field("version_minor", "H", "the lowest minor version that defines everything the file uses: 0, or 1 for "
          "expert formats 5 and 6; a reader reads any minor version (§11)"),
    Field("flags", "I", "no flag is defined in v1: MUST be 0"),
    Field("file_size", "Q", "total file size in bytes; MUST equal the real size"),
    Field("alignment", "I", "expert blob alignment; MUST be 4096"),
    Field("num_layers", "I", "transformer layers, 1..1024"),
    Field("num_moe_layers", "I", "layers with routed experts, 1..num_layers"),
    Field("num_experts", "I", "routed experts per MoE layer, 1..4096"),
    Field("top_k", "I", "experts chosen per token, 1..min(num_experts, 64)"),
    Field("num_dense_tensors", "I", "entries in the dense-tensor directory, 1..65536"),
    Field("hidden_size", "I", "H, multiple of 16, <= 65536"),
    Field("expert_intermediate_size", "I", "I, multiple of 16, <= 2^20"),
    Field("expert_format", "H", "ExpertFormat code (0..6, §8); 5 and 6 need version_minor >= 1"),
    Field("reserved0", "H", "MUST be 0"),
    Field("group_size", "I", "inputs per scale along a row: INT8_GROUP a multiple of 16, INT4_GROUP 32, 64 or 128, "
          "MXFP4 32, dividing H and I; else 0"),
    Field("expert_blob_size", "Q", "bytes per expert blob; MUST equal the size the blob layout implies"),
    Field("data_offset", "Q", "first dense tensor; MUST be 4096"),
    Field("experts_offset", "Q", "first expert blob; MUST equal the planned offset"),
    Field("metadata_offset", "Q", "section table: metadata offset"),
    Field("metadata_size", "Q", "metadata size in bytes, 2..64 MiB"),
    Field("metadata_checksum", "Q", "XXH3-64 of the metadata bytes, seeded (see Checksums)"),
    Field("dense_dir_offset", "Q", "section table: dense-tensor directory offset"),
    Field("dense_dir_size", "Q", "num_dense_tensors * 192"),
    Field("dense_dir_checksum", "Q", "XXH3-64 of the directory bytes, seeded"),
    Field("wsit_offset", "Q", "section table: WSIT offset"),
    Field("wsit_size", "Q", "num_moe_layers * num_experts * 32"),
    Field("wsit_checksum", "Q", "XXH3-64 of the WSIT bytes, seeded"),
    Field("reserved", "336s", "MUST be all zero"),
    Field("header_checksum", "Q", "XXH3-64 (seed 0) of header bytes 0..503"),
)

DENSE_ENTRY_FIELDS: tuple[Field, ...] = (
    Field("name", "128s", "ASCII canonical name, NUL-padded; 1..127 bytes of [A-Za-z0-9_.]"),
    Field("dtype", "H", "DType code: 0 F32, 1 F16, 2 BF16"),
    Field("rank", "H", "1..4"),
    Field("reserved", "I", "MUST be 0"),
    Field("shape", "4Q", "dimensions, outermost first; unused dimensions MUST be 0, used ones 1..2^24"),
    Field("offset", "Q", "absolute offset of the tensor data"),
    Field("size", "Q", "bytes; MUST equal product(shape) * dtype size"),
    Field("checksum", "Q", "XXH3-64 of the tensor bytes, seeded with its name and offset"),
)

WSIT_ENTRY_FIELDS: tuple[Field, ...] = (
    Field("layer", "I", "transformer layer index of this MoE layer"),
    Field("expert", "I", "expert index, 0..num_experts-1"),
    Field("offset", "Q", "absolute offset of the blob, multiple of 4096"),
    Field("size", "Q", "blob bytes; MUST equal expert_blob_size"),
    Field("checksum", "Q", "XXH3-64 of the blob, seeded with (layer, expert, offset)"),
)

HEADER_FMT = _fmt(HEADER_FIELDS)
DENSE_ENTRY_FMT = _fmt(DENSE_ENTRY_FIELDS)
WSIT_ENTRY_FMT = _fmt(WSIT_ENTRY_FIELDS)
HEADER_CHECKED_SIZE = C.HEADER_CHECKED_SIZE

# Import-time size checks: a mistake in a field table must fail loudly, not silently move bytes.
if struct.calcsize(HEADER_FMT) != C.HEADER_SIZE:
    raise ImportError(f"header struct is {struct.calcsize(HEADER_FMT)} bytes, not {C.HEADER_SIZE}")
if struct.calcsize(DENSE_ENTRY_FMT) != C.DENSE_ENTRY_SIZE:
    raise ImportError("dense directory entry size drifted from DENSE_ENTRY_SIZE")
if struct.calcsize(WSIT_ENTRY_FMT) != C.WSIT_ENTRY_SIZE:
    raise ImportError("WSIT entry size drifted from WSIT_ENTRY_SIZE")


@dataclass(frozen=True)
class Header:
    """The 512-byte header. `pack()` fills in the header checksum; `unpack()` does no validation."""

    magic: bytes
    version_major: int
    version_minor: int
    flags: int
    file_size: int
    alignment: int
    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    num_dense_tensors: int
    hidden_size: int
    expert_intermediate_size: int
    expert_format: int
    reserved0: int
    group_size: int
    expert_blob_size: int
    data_offset: int
    experts_offset: int
    metadata_offset: int
    metadata_size: int
    metadata_checksum: int
    dense_dir_offset: int
    dense_dir_size: int
    dense_dir_checksum: int
    wsit_offset: int
    wsit_size: int
    wsit_checksum: int
    reserved: bytes = bytes(336)
    header_checksum: int = 0

    STRUCT: ClassVar[struct.Struct] = struct.Struct(HEADER_FMT)

    def pack(self) -> bytes:
        raw = self.STRUCT.pack(*astuple(self))
        digest = header_checksum(raw)
        return raw[:HEADER_CHECKED_SIZE] + struct.pack("<Q", digest)

    @classmethod
    def unpack(cls, buf: bytes) -> Header:
        return cls(*cls.STRUCT.unpack(buf))

    @property
    def num_blobs(self) -> int:
        return self.num_moe_layers * self.num_experts


@dataclass(frozen=True)
class DenseEntry:
    name: str
    dtype: int
    rank: int
    reserved: int
    shape: tuple[int, ...]      # the used dimensions only
    offset: int
    size: int
    checksum: int

    STRUCT: ClassVar[struct.Struct] = struct.Struct(DENSE_ENTRY_FMT)

    def pack(self) -> bytes:
        dims = tuple(self.shape) + (0,) * (C.MAX_RANK - len(self.shape))
        return self.STRUCT.pack(self.name.encode("utf-8"), self.dtype, self.rank, self.reserved,
                                *dims, self.offset, self.size, self.checksum)

    @classmethod
    def unpack_raw(cls, buf: bytes) -> tuple:
        """Raw field tuple: (name_bytes, dtype, rank, reserved, d0, d1, d2, d3, offset, size, checksum)."""
        return cls.STRUCT.unpack(buf)


@dataclass(frozen=True)
class WsitEntry:
    layer: int
    expert: int
    offset: int
    size: int
    checksum: int

    STRUCT: ClassVar[struct.Struct] = struct.Struct(WSIT_ENTRY_FMT)

    def pack(self) -> bytes:
        return self.STRUCT.pack(*astuple(self))

    @classmethod
    def unpack(cls, buf: bytes) -> WsitEntry:
        return cls(*cls.STRUCT.unpack(buf))


HEADER_FIELD_OFFSETS = field_offsets(HEADER_FIELDS)
DENSE_ENTRY_FIELD_OFFSETS = field_offsets(DENSE_ENTRY_FIELDS)
WSIT_ENTRY_FIELD_OFFSETS = field_offsets(WSIT_ENTRY_FIELDS)

if [f.name for f in fields(Header)] != [f.name for f in HEADER_FIELDS]:
    raise ImportError("Header dataclass fields drifted from HEADER_FIELDS")

"""Where every byte goes: the expert blob layout and the planned layout of a whole file.

The layout is a pure function of the header counts and the dense directory (names, dtypes, shapes), so
the writer can plan every offset before writing a byte (and resume), and the reader can demand that a
file has exactly the planned layout: one canonical layout, no gaps, no overlaps, no trailing bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import constants as C


def align_up(value: int, alignment: int) -> int:
    """Round up to a multiple of `alignment` (a power of two), on Python ints (no overflow)."""
    return (value + alignment - 1) // alignment * alignment


def num_elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class BlobArray:
    name: str
    offset: int                 # from the start of the blob
    shape: tuple[int, int]
    dtype: C.DType

    @property
    def nbytes(self) -> int:
        return num_elements(self.shape) * C.DTYPE_SIZE[self.dtype]


@dataclass(frozen=True)
class BlobLayout:
    hidden_size: int
    intermediate_size: int
    expert_format: C.ExpertFormat
    group_size: int             # 0 unless a grouped format (INT8_GROUP, INT4_GROUP, MXFP4)
    arrays: tuple[BlobArray, ...]
    size: int                   # multiple of BLOB_ALIGNMENT

    def array(self, name: str) -> BlobArray:
        for a in self.arrays:
            if a.name == name:
                return a
        raise KeyError(name)

    def padding_ranges(self) -> list[tuple[int, int]]:
        """Byte ranges inside the blob that MUST be zero."""
        out, pos = [], 0
        for a in self.arrays:
            if a.offset > pos:
                out.append((pos, a.offset))
            pos = a.offset + a.nbytes
        if self.size > pos:
            out.append((pos, self.size))
        return out


def blob_array_specs(hidden_size: int, intermediate_size: int, expert_format: C.ExpertFormat,
                     group_size: int = 0) -> list[tuple[str, tuple[int, int], C.DType]]:
    """(name, stored shape, element type) of each array of a blob, in blob order. Packed formats (INT4_GROUP,
    MXFP4) store two values a byte: their matrices are [rows, inputs / 2] bytes."""
    fmt = C.ExpertFormat(expert_format)
    h, i = hidden_size, intermediate_size
    dtype = C.EXPERT_FORMAT_DTYPE[fmt]
    if fmt not in C.QUANTIZED_FORMATS:
        return [("gate_up", (2 * i, h), dtype), ("down", (h, i), dtype)]
    per_byte = 2 if fmt in C.PACKED_FORMATS else 1
    g_in_h = 1 if fmt == C.ExpertFormat.INT8_ROW else h // group_size
    g_in_i = 1 if fmt == C.ExpertFormat.INT8_ROW else i // group_size
    scale = C.SCALE_DTYPE[fmt]
    return [("gate_up", (2 * i, h // per_byte), dtype), ("gate_up_scale", (2 * i, g_in_h), scale),
            ("down", (h, i // per_byte), dtype), ("down_scale", (h, g_in_i), scale)]


def blob_layout(hidden_size: int, intermediate_size: int, expert_format: C.ExpertFormat,
                group_size: int = 0) -> BlobLayout:
    """Arrays of one expert blob: gate_up [2I,H], (scale), down [H,I], (scale); 256-byte aligned."""
    fmt = C.ExpertFormat(expert_format)
    arrays, pos = [], 0
    for name, shape, dt in blob_array_specs(hidden_size, intermediate_size, fmt, group_size):
        pos = align_up(pos, C.ARRAY_ALIGNMENT)
        arr = BlobArray(name, pos, shape, dt)
        arrays.append(arr)
        pos += arr.nbytes
    group = group_size if fmt in C.GROUPED_FORMATS else 0
    return BlobLayout(hidden_size, intermediate_size, fmt, group, tuple(arrays), align_up(pos, C.BLOB_ALIGNMENT))


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: C.DType
    shape: tuple[int, ...]
    offset: int
    size: int


@dataclass(frozen=True)
class FilePlan:
    """Offsets of every dense tensor and expert blob, and where the sections begin."""

    dense: tuple[PlannedTensor, ...]
    moe_layers: tuple[int, ...]
    num_experts: int
    blob: BlobLayout
    experts_offset: int
    metadata_offset: int

    def blob_index(self, layer: int, expert: int) -> int:
        return self.moe_layers.index(layer) * self.num_experts + expert

    def blob_offset(self, layer: int, expert: int) -> int:
        return self.experts_offset + self.blob_index(layer, expert) * self.blob.size

    def blob_keys(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer in self.moe_layers for e in range(self.num_experts)]

    def sections(self, metadata_size: int, num_dense: int) -> tuple[int, int, int, int]:
        """(dense_dir_offset, wsit_offset, wsit_size, file_size) once the metadata size is known."""
        dir_offset = align_up(self.metadata_offset + metadata_size, C.SECTION_ALIGNMENT)
        wsit_offset = dir_offset + num_dense * C.DENSE_ENTRY_SIZE
        wsit_size = len(self.moe_layers) * self.num_experts * C.WSIT_ENTRY_SIZE
        return dir_offset, wsit_offset, wsit_size, wsit_offset + wsit_size

    def zero_ranges(self, metadata_size: int) -> list[tuple[int, int]]:
        """Absolute byte ranges between the planned pieces that MUST be zero."""
        out = [(C.HEADER_SIZE, C.DATA_OFFSET)]
        pos = C.DATA_OFFSET
        for t in self.dense:
            out.append((pos, t.offset))
            pos = t.offset + t.size
        out.append((pos, self.experts_offset))
        dir_offset, _, _, _ = self.sections(metadata_size, len(self.dense))
        out.append((self.metadata_offset + metadata_size, dir_offset))
        return [(a, b) for a, b in out if b > a]


def plan_file(dense: list[tuple[str, C.DType, tuple[int, ...]]], moe_layers: tuple[int, ...],
              num_experts: int, blob: BlobLayout) -> FilePlan:
    """Plan the canonical layout: header, dense tensors (256-aligned), blobs (4096-aligned), sections."""
    planned, pos = [], C.DATA_OFFSET
    for name, dtype, shape in dense:
        pos = align_up(pos, C.ARRAY_ALIGNMENT)
        size = num_elements(shape) * C.DTYPE_SIZE[C.DType(dtype)]
        planned.append(PlannedTensor(name, C.DType(dtype), tuple(shape), pos, size))
        pos += size
    experts_offset = align_up(pos, C.BLOB_ALIGNMENT)
    experts_end = experts_offset + len(moe_layers) * num_experts * blob.size
    return FilePlan(tuple(planned), tuple(moe_layers), num_experts, blob, experts_offset, experts_end)

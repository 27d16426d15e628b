"""Constants, enums and limits of the `.colibri` v1 format (normative: docs/spec.md)."""

from __future__ import annotations

import enum

MAGIC = b"COLIBRIv1"
MAGIC_FIELD_SIZE = 16                     # magic, NUL-padded
VERSION_MAJOR = 1
VERSION_MINOR = 1                         # the newest minor version this reader implements (see MINOR_VERSION_OF)

HEADER_SIZE = 512
HEADER_CHECKED_SIZE = HEADER_SIZE - 8      # header bytes the header checksum covers (all but itself)
BLOB_ALIGNMENT = 4096                     # expert blobs and the start of tensor data
ARRAY_ALIGNMENT = 256                     # dense tensors and arrays inside a blob
SECTION_ALIGNMENT = 64                    # metadata, dense directory, WSIT
DATA_OFFSET = BLOB_ALIGNMENT              # first dense tensor

DENSE_ENTRY_SIZE = 192
WSIT_ENTRY_SIZE = 32
DENSE_NAME_SIZE = 128                     # name field, NUL-padded
NUM_SECTIONS = 3

# --- limits a reader enforces before allocating or reading anything -------------------------------
# The format's limits, defined here only (the header checks, the metadata checks and the docs read them).
# An engine may run less: the CUDA kernels' own caps are in runtime/cuda/limits.py (check_cuda_support).
MAX_LAYERS = 1024
MAX_EXPERTS = 4096                        # routed experts per MoE layer
MAX_TOP_K = 64                            # experts per token; also at most num_experts
MAX_WSIT_ENTRIES = 1 << 20                # 32 MiB of WSIT
MAX_DENSE_TENSORS = 1 << 16               # 12 MiB of directory
MAX_RANK = 4
MAX_DIM = 1 << 24
MAX_HIDDEN = 1 << 16
MAX_EXPERT_INTERMEDIATE = 1 << 20
MAX_NAME_LENGTH = DENSE_NAME_SIZE - 1
MAX_METADATA_BYTES = 64 << 20
MAX_JSON_DEPTH = 16
MAX_JSON_ELEMENTS = 1 << 20                # arrays, objects and their members in the metadata JSON (the
                                          # largest real files, 384-expert models, hold ~0.15 M)
DIM_MULTIPLE = 16                         # H, I and group sizes: 16-byte vector loads
MIN_GROUP_SIZE = 16
INT4_GROUP_SIZES = (32, 64, 128)          # int4_group: a group is 16, 32 or 64 whole bytes of a row
MXFP4_GROUP_SIZE = 32                     # OCP MX: one E8M0 scale per 32 FP4 values


class DType(enum.IntEnum):
    """Element type of a dense tensor or of unquantized expert matrices."""

    F32 = 0
    F16 = 1
    BF16 = 2
    I8 = 3     # only inside quantized expert blobs
    I4X2 = 4   # only inside int4_group blobs: a byte holding two signed 4-bit integers (v1.1)
    FP4X2 = 5  # only inside mxfp4 blobs: a byte holding two FP4 E2M1 values (v1.1)
    E8M0 = 6   # only inside mxfp4 blobs: a power-of-two scale 2^(byte - 127) (v1.1)


DTYPE_SIZE = {DType.F32: 4, DType.F16: 2, DType.BF16: 2, DType.I8: 1, DType.I4X2: 1, DType.FP4X2: 1, DType.E8M0: 1}
DTYPE_NAMES = {"float32": DType.F32, "float16": DType.F16, "bfloat16": DType.BF16}
DENSE_DTYPES = frozenset({DType.F32, DType.F16, DType.BF16})


class ExpertFormat(enum.IntEnum):
    """How expert matrices are stored inside a blob."""

    F32 = 0
    F16 = 1
    BF16 = 2
    INT8_ROW = 3     # int8, one float32 scale per output row
    INT8_GROUP = 4   # int8, one float32 scale per `group_size` inputs of a row
    INT4_GROUP = 5   # v1.1: signed 4-bit pairs, one float16 scale per `group_size` (32, 64, 128) inputs of a row
    MXFP4 = 6        # v1.1: OCP MX FP4 (E2M1 pairs), one E8M0 scale per 32 inputs of a row


QUANTIZED_FORMATS = frozenset({ExpertFormat.INT8_ROW, ExpertFormat.INT8_GROUP, ExpertFormat.INT4_GROUP,
                               ExpertFormat.MXFP4})
GROUPED_FORMATS = frozenset({ExpertFormat.INT8_GROUP, ExpertFormat.INT4_GROUP, ExpertFormat.MXFP4})
PACKED_FORMATS = frozenset({ExpertFormat.INT4_GROUP, ExpertFormat.MXFP4})   # two values a byte
EXPERT_FORMAT_NAMES = {
    ExpertFormat.F32: "float32", ExpertFormat.F16: "float16", ExpertFormat.BF16: "bfloat16",
    ExpertFormat.INT8_ROW: "int8_row", ExpertFormat.INT8_GROUP: "int8_group",
    ExpertFormat.INT4_GROUP: "int4_group", ExpertFormat.MXFP4: "mxfp4",
}
EXPERT_FORMAT_BY_NAME = {name: fmt for fmt, name in EXPERT_FORMAT_NAMES.items()}
EXPERT_FORMAT_DTYPE = {
    ExpertFormat.F32: DType.F32, ExpertFormat.F16: DType.F16, ExpertFormat.BF16: DType.BF16,
    ExpertFormat.INT8_ROW: DType.I8, ExpertFormat.INT8_GROUP: DType.I8,
    ExpertFormat.INT4_GROUP: DType.I4X2, ExpertFormat.MXFP4: DType.FP4X2,
}
SCALE_DTYPE = {ExpertFormat.INT8_ROW: DType.F32, ExpertFormat.INT8_GROUP: DType.F32,
               ExpertFormat.INT4_GROUP: DType.F16, ExpertFormat.MXFP4: DType.E8M0}
EXPERT_FORMAT_BITS = {ExpertFormat.F32: 32, ExpertFormat.F16: 16, ExpertFormat.BF16: 16, ExpertFormat.INT8_ROW: 8,
                      ExpertFormat.INT8_GROUP: 8, ExpertFormat.INT4_GROUP: 4, ExpertFormat.MXFP4: 4}
# The minor version that introduced each expert format: a file declares (at least) the one its format needs, and a
# reader refuses a format code its own minor version does not define.
MINOR_VERSION_OF = {fmt: 1 if fmt in PACKED_FORMATS else 0 for fmt in ExpertFormat}


def minor_version_for(expert_format: ExpertFormat) -> int:
    """The `version_minor` a writer puts in a file with these experts: the lowest that defines them, so a file
    that a 1.0 reader can read says 1.0."""
    return MINOR_VERSION_OF[ExpertFormat(expert_format)]


class Section(enum.IntEnum):
    """Order of the section table entries in the header."""

    METADATA = 0
    DENSE_DIRECTORY = 1
    WSIT = 2

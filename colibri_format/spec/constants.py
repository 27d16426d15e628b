"""Constants, enums and limits of the `.colibri` v1 format (normative: docs/spec.md)."""

from __future__ import annotations

import enum

MAGIC = b"COLIBRIv1"
MAGIC_FIELD_SIZE = 16                     # magic, NUL-padded
VERSION_MAJOR = 1
VERSION_MINOR = 0

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


class DType(enum.IntEnum):
    """Element type of a dense tensor or of unquantized expert matrices."""

    F32 = 0
    F16 = 1
    BF16 = 2
    I8 = 3   # only inside quantized expert blobs


DTYPE_SIZE = {DType.F32: 4, DType.F16: 2, DType.BF16: 2, DType.I8: 1}
DTYPE_NAMES = {"float32": DType.F32, "float16": DType.F16, "bfloat16": DType.BF16}
DENSE_DTYPES = frozenset({DType.F32, DType.F16, DType.BF16})


class ExpertFormat(enum.IntEnum):
    """How expert matrices are stored inside a blob."""

    F32 = 0
    F16 = 1
    BF16 = 2
    INT8_ROW = 3     # int8, one float32 scale per output row
    INT8_GROUP = 4   # int8, one float32 scale per `group_size` inputs of a row


QUANTIZED_FORMATS = frozenset({ExpertFormat.INT8_ROW, ExpertFormat.INT8_GROUP})
EXPERT_FORMAT_NAMES = {
    ExpertFormat.F32: "float32", ExpertFormat.F16: "float16", ExpertFormat.BF16: "bfloat16",
    ExpertFormat.INT8_ROW: "int8_row", ExpertFormat.INT8_GROUP: "int8_group",
}
EXPERT_FORMAT_DTYPE = {
    ExpertFormat.F32: DType.F32, ExpertFormat.F16: DType.F16, ExpertFormat.BF16: DType.BF16,
    ExpertFormat.INT8_ROW: DType.I8, ExpertFormat.INT8_GROUP: DType.I8,
}


class Section(enum.IntEnum):
    """Order of the section table entries in the header."""

    METADATA = 0
    DENSE_DIRECTORY = 1
    WSIT = 2

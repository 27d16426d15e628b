"""One crafted bad file per applicable row of the bad-input catalogue (reference/bad_inputs.md §3).

Each file starts as a valid synthetic file; one field is patched and whatever seals that field (the header
checksum, the section checksum of a directory or WSIT entry, a blob checksum) is recomputed, so that the
check under test, not the checksum in front of it, is the one that fires. For every case we assert:

* the exact ColibriFormatError subclass, from `load_tables`, `colibri_format.open` and `inspect_file`
  (or, for faults in tensor/blob bytes and padding, from `validate_file` / first use);
* `field` names the patched field (and appears in the message), `offset` is the byte offset of that field;
* `validate_file` reports it, and `colibri validate` exits 1 (2 when the path is not a regular file: then every
  reader, `validate_file` included, raises NotARegularFile);
* no other exception type ever escapes.

Rows not applicable to a `.colibri` reader: 31, 35, 36 (shard paths, pickles, safetensors input: the
converter's tests cover them). Row 34 (file truncated by another process while it is read): `validate` reads
with pread and raises TruncatedFile (tests/inspect/test_validate_reads.py); a mapping held by `open` would still
die by SIGBUS, so the writer never truncates in place (tmp + rename), and `open` checks the size it sees.
Rows whose values cannot be stored in the field (2^64-1 in a 32-bit count) use the field's maximum.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

import colibri_format
from colibri_format import errors as E
from colibri_format import spec as S
from colibri_format.cli import main as cli_main
from colibri_format.inspect import inspect_file, validate_file
from colibri_format.reader import load_tables
from colibri_format.spec.structs import DENSE_ENTRY_FIELD_OFFSETS, HEADER_FIELD_OFFSETS, WSIT_ENTRY_FIELD_OFFSETS
from tests.spec import craft

pytestmark = pytest.mark.timeout(120)

TWO_LAYERS = dict(craft.SMALL_MODEL, layers=2)


@functools.lru_cache(maxsize=None)
def _base(kind: str) -> bytes:
    if kind == "small":
        return bytes(craft.valid_bytes())
    if kind == "two_layers":
        return bytes(craft.valid_bytes(TWO_LAYERS))
    if kind == "group":
        return bytes(craft.valid_bytes(dict(craft.SMALL_MODEL, hidden=32, expert_inter=32, heads=2),
                                       expert_format=S.ExpertFormat.INT8_GROUP, group_size=16))
    if kind in ("int4", "mxfp4"):      # v1.1 files, H = I = 32: one group of 32 a row
        return bytes(craft.valid_bytes(craft.SMALL_4BIT_MODEL, **craft.FOUR_BIT[kind]))
    raise KeyError(kind)


def base(kind: str = "small") -> bytearray:
    return bytearray(_base(kind))


def H(name: str) -> int:
    return HEADER_FIELD_OFFSETS[name][0]


def dense_off(buf, k: int, name: str) -> int:
    return craft.dense_entry_base(buf, k) + DENSE_ENTRY_FIELD_OFFSETS[name][0]


def wsit_off(buf, k: int, name: str) -> int:
    return craft.wsit_entry_base(buf, k) + WSIT_ENTRY_FIELD_OFFSETS[name][0]


def meta_obj(buf) -> dict:
    return json.loads(craft.metadata_bytes(buf))


def with_meta(buf, meta_or_raw) -> bytearray:
    raw = meta_or_raw if isinstance(meta_or_raw, bytes) else \
        json.dumps(meta_or_raw, sort_keys=True, separators=(",", ":")).encode()
    return craft.rewrite_metadata(buf, raw)


def edit_meta(buf, fn) -> bytearray:
    meta = meta_obj(buf)
    fn(meta)
    return with_meta(buf, meta)


# --- the case table -------------------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    build: Callable[[], bytearray]
    exc: type
    field: str                       # substring expected in exc.field
    offset: Callable | int | None = None   # expected exc.offset (callable: f(buf) -> int); None: any int
    stage: str = "open"              # "open": tables reject it; "data": only validate / first use
    message: str | None = None       # substring expected in the message


CASES: list[Case] = []


def case(*args, **kwargs) -> None:
    CASES.append(Case(*args, **kwargs))


# Row 1: too short for a header.
case("r1-empty", lambda: bytearray(), E.TruncatedFile, "file_size", 0)
case("r1-100-bytes", lambda: base()[:100], E.TruncatedFile, "file_size", 0)
case("r1-511-bytes", lambda: base()[:511], E.TruncatedFile, "file_size", 0)

# Row 3: magic.
case("r3-gguf", lambda: bytearray(b"GGUF\x03\x00\x00\x00") + base()[8:], E.BadMagic, "magic", 0)
case("r3-zeros", lambda: bytearray(len(base())), E.BadMagic, "magic", 0)
case("r3-nul-colibri", lambda: bytearray(b"\x00COLIBRIv1") + base()[10:], E.BadMagic, "magic", 0)
case("r3-non-nul-pad", lambda: craft.patch_header(base(), magic=b"COLIBRIv1\x00\x00\x00\x00\x00\x00X"),
     E.BadMagic, "magic", 0)
case("r3-v2-magic", lambda: craft.patch_header(base(), magic=b"COLIBRIv2"), E.BadMagic, "magic", 0)

# Row 4: versions (checked before the header checksum, so a future header layout still gets this message).
for v in (0, 2, 0xFFFF):
    case(f"r4-major-{v}", lambda v=v: craft.patch_header(base(), version_major=v), E.UnsupportedVersion,
         "version_major", H("version_major"))
case("r4-byte-swapped", lambda: craft.patch_header(base(), version_major=0x0100), E.UnsupportedVersion,
     "version_major", H("version_major"), message="byte-swapped")
case("r4-major-2-stale-checksum", lambda: craft.patch_header(base(), fix=False, version_major=2),
     E.UnsupportedVersion, "version_major", H("version_major"))

# Row 5: flags, reserved fields and bytes.
for v in (1, 0x80000000, 0xFFFFFFFF):
    case(f"r5-flags-{v:#x}", lambda v=v: craft.patch_header(base(), flags=v), E.CorruptHeader, "flags", H("flags"))
case("r5-reserved0", lambda: craft.patch_header(base(), reserved0=1), E.CorruptHeader, "reserved0", H("reserved0"))
case("r5-reserved-first", lambda: craft.patch_header(base(), reserved=b"\x01"), E.CorruptHeader, "reserved",
     H("reserved"))
case("r5-reserved-last", lambda: craft.patch_header(base(), reserved=bytes(335) + b"\x80"), E.CorruptHeader,
     "reserved", H("reserved"))
case("r5-dense-reserved", lambda: craft.patch_dense_entry(base(), 2, reserved=1), E.InvalidDirectoryEntry,
     "dense[2].reserved", lambda b: dense_off(b, 2, "reserved"))

# Row 6: header checksum: any unsealed change, even to a count that would be out of range, is CorruptHeader.
case("r6-checksum-bitflip", lambda: craft.patch_header(base(), fix=False, header_checksum=craft.header_of(
    base()).header_checksum ^ 1), E.CorruptHeader, "header_checksum", H("header_checksum"))
case("r6-unsealed-num-experts", lambda: craft.patch_header(base(), fix=False, num_experts=2**32 - 1),
     E.CorruptHeader, "header_checksum", H("header_checksum"))
case("r6-unsealed-file-size", lambda: craft.patch_header(base(), fix=False, file_size=1), E.CorruptHeader,
     "header_checksum", H("header_checksum"))

# Row 7: counts: 0, over the cap, all-ones (2^64-1 does not fit a u32 count).
for name, values in {
    "num_layers": (0, S.MAX_LAYERS + 1, 2**32 - 1),
    "num_moe_layers": (0, 2, 2**32 - 1),           # 2 > num_layers == 1
    "num_experts": (0, S.MAX_EXPERTS + 1, 2**32 - 1),
    "top_k": (0, 3, S.MAX_TOP_K + 1, 2**32 - 1),   # 3 > num_experts == 2
    "num_dense_tensors": (0, S.MAX_DENSE_TENSORS + 1, 2**32 - 1),
    "hidden_size": (0, 8, 24, S.MAX_HIDDEN + 16, 2**32 - 1),
    "expert_intermediate_size": (0, 8, 17, S.MAX_EXPERT_INTERMEDIATE + 16, 2**32 - 1),
}.items():
    for v in values:
        case(f"r7-{name}-{v}", lambda name=name, v=v: craft.patch_header(base(), **{name: v}),
             E.InvalidHeaderField, name, H(name))

# Row 8: products over their caps, sizes that disagree with the counts.
case("r8-blobs-over-cap", lambda: craft.patch_header(base(), num_layers=1024, num_moe_layers=1024, num_experts=4096,
                                                     top_k=1), E.InvalidHeaderField, "num_experts", H("num_experts"),
     message="exceeds")
case("r8-dense-dir-size", lambda: craft.patch_header(base(), dense_dir_size=2**64 - 1), E.InvalidHeaderField,
     "dense_dir_size", H("dense_dir_size"))
case("r8-dense-count-vs-size", lambda: craft.patch_header(base(), num_dense_tensors=10), E.InvalidHeaderField,
     "dense_dir_size", H("dense_dir_size"))
case("r8-wsit-size", lambda: craft.patch_header(base(), wsit_size=2**64 - 1), E.InvalidHeaderField, "wsit_size",
     H("wsit_size"))
case("r8-experts-vs-wsit-size", lambda: craft.patch_header(base(), num_experts=1), E.InvalidHeaderField,
     "wsit_size", H("wsit_size"))
case("r8-group-size-not-int8-group", lambda: craft.patch_header(base(), group_size=16), E.InvalidHeaderField,
     "group_size", H("group_size"))
for g in (0, 8, 24, 64, 2**32 - 1):     # group file: H = I = 32
    case(f"r8-group-size-{g}", lambda g=g: craft.patch_header(base("group"), group_size=g), E.InvalidHeaderField,
         "group_size", H("group_size"))
# int4_group takes 32, 64 or 128 dividing H and I, mxfp4 32 only (H = I = 32 here: 64 and 128 do not divide)
for kind, groups in (("int4", (0, 16, 48, 64, 128, 2**32 - 1)), ("mxfp4", (0, 16, 64, 2**32 - 1))):
    for g in groups:
        case(f"r8-{kind}-group-size-{g}", lambda kind=kind, g=g: craft.patch_header(base(kind), group_size=g),
             E.InvalidHeaderField, "group_size", H("group_size"))

# Rows 9-11, 30: every offset and section size, each sum checked with exact integers.
# experts_offset 4096 is aligned and inside the file: the blobs then end early, and the check that fires is
# "metadata_offset must follow the last blob" (the two fields contradict each other; the later one is named).
case("r9-experts_offset-4096", lambda: craft.patch_header(base(), experts_offset=4096), E.LayoutError,
     "metadata_offset", H("metadata_offset"))
for name, v in (("experts_offset", 0), ("experts_offset", 8193), ("experts_offset", 2**64 - 4096), ("metadata_offset", 0), ("metadata_offset", 16383),
                ("metadata_offset", 2**64 - 1), ("dense_dir_offset", 0), ("dense_dir_offset", 17281),
                ("dense_dir_offset", 2**64 - 1), ("wsit_offset", 0), ("wsit_offset", 19009),
                ("wsit_offset", 2**64 - 64)):
    case(f"r9-{name}-{v}", lambda name=name, v=v: craft.patch_header(base(), **{name: v}), E.LayoutError, name,
         H(name))
case("r9-data-offset", lambda: craft.patch_header(base(), data_offset=512), E.InvalidHeaderField, "data_offset",
     H("data_offset"))
case("r9-data-offset-max", lambda: craft.patch_header(base(), data_offset=2**64 - 1), E.InvalidHeaderField,
     "data_offset", H("data_offset"))
case("r11-metadata-size-0", lambda: craft.patch_header(base(), metadata_size=0), E.InvalidHeaderField,
     "metadata_size", H("metadata_size"))
case("r11-metadata-size-over-cap", lambda: craft.patch_header(base(), metadata_size=S.MAX_METADATA_BYTES + 1),
     E.InvalidHeaderField, "metadata_size", H("metadata_size"))
case("r11-metadata-size-max", lambda: craft.patch_header(base(), metadata_size=2**64 - 1), E.InvalidHeaderField,
     "metadata_size", H("metadata_size"))
case("r30-metadata-size-past-eof", lambda: craft.patch_header(base(), metadata_size=S.MAX_METADATA_BYTES),
     E.LayoutError, "dense_dir_offset", H("dense_dir_offset"))
case("r30-metadata-overlaps-directory", lambda: craft.patch_header(base(), metadata_size=1000), E.LayoutError,
     "dense_dir_offset", H("dense_dir_offset"))

# Row 12: alignment is a fixed constant.
for v in (0, 8, 4095, 8192, 2**31, 2**32 - 1):
    case(f"r12-alignment-{v}", lambda v=v: craft.patch_header(base(), alignment=v), E.InvalidHeaderField,
         "alignment", H("alignment"))

# Rows 13-20: WSIT entries (k = 1 unless noted).
case("r13-blob-offset-past-eof", lambda: craft.patch_wsit_entry(base(), 1, offset=1 << 40), E.InvalidDirectoryEntry,
     "wsit[1].offset", lambda b: wsit_off(b, 1, "offset"))
case("r13-blob-offset-max", lambda: craft.patch_wsit_entry(base(), 1, offset=2**64 - 4096),
     E.InvalidDirectoryEntry, "wsit[1].offset", lambda b: wsit_off(b, 1, "offset"))
case("r13-blob-size-max", lambda: craft.patch_wsit_entry(base(), 1, size=2**64 - 1), E.InvalidDirectoryEntry,
     "wsit[1].size", lambda b: wsit_off(b, 1, "size"))
case("r14-blob-size-0", lambda: craft.patch_wsit_entry(base(), 0, size=0), E.InvalidDirectoryEntry, "wsit[0].size",
     lambda b: wsit_off(b, 0, "size"))
case("r15-blob-size-double", lambda: craft.patch_wsit_entry(base(), 0, size=8192), E.InvalidDirectoryEntry,
     "wsit[0].size", lambda b: wsit_off(b, 0, "size"))
case("r15-expert-blob-size", lambda: craft.patch_header(base(), expert_blob_size=8192), E.InvalidHeaderField,
     "expert_blob_size", H("expert_blob_size"))
case("r16-overlap", lambda: craft.patch_wsit_entry(base(), 1, offset=8192), E.InvalidDirectoryEntry,
     "wsit[1].offset", lambda b: wsit_off(b, 1, "offset"))
case("r17-gap", lambda: craft.patch_wsit_entry(base(), 1, offset=8192 + 8192), E.InvalidDirectoryEntry,
     "wsit[1].offset", lambda b: wsit_off(b, 1, "offset"))


def _swap_wsit_entries(buf, i, j):
    a, b = craft.wsit_entry_base(buf, i), craft.wsit_entry_base(buf, j)
    ea, eb = bytes(buf[a:a + 32]), bytes(buf[b:b + 32])
    buf[a:a + 32], buf[b:b + 32] = eb, ea
    craft.fix_section_checksums(buf)
    return buf


case("r18-entries-swapped", lambda: _swap_wsit_entries(base(), 0, 1), E.InvalidDirectoryEntry, "wsit[0].expert",
     lambda b: wsit_off(b, 0, "expert"))
case("r18-layers-out-of-order", lambda: craft.patch_wsit_entry(craft.patch_wsit_entry(
    base("two_layers"), 0, layer=1, fix=False), 1, layer=1), E.InvalidDirectoryEntry, "wsit[2].layer",
    lambda b: wsit_off(b, 2, "layer"))      # runs [1, 1]: the second run is the first one not increasing
case("r18-layer-runs-decreasing", lambda: craft.patch_wsit_entry(craft.patch_wsit_entry(
    craft.patch_wsit_entry(craft.patch_wsit_entry(base("two_layers"), 0, layer=1, fix=False), 1, layer=1, fix=False),
    2, layer=0, fix=False), 3, layer=0), E.InvalidDirectoryEntry, "wsit[2].layer", lambda b: wsit_off(b, 2, "layer"))
case("r19-blob-offset-misaligned", lambda: craft.patch_wsit_entry(base(), 0, offset=8192 + 256),
     E.InvalidDirectoryEntry, "wsit[0].offset", lambda b: wsit_off(b, 0, "offset"))
case("r20-duplicate-pair", lambda: craft.patch_wsit_entry(base(), 1, expert=0), E.InvalidDirectoryEntry,
     "wsit[1].expert", lambda b: wsit_off(b, 1, "expert"))
case("r20-expert-eq-count", lambda: craft.patch_wsit_entry(base(), 1, expert=2), E.InvalidDirectoryEntry,
     "wsit[1].expert", lambda b: wsit_off(b, 1, "expert"))
case("r20-expert-negative-as-signed", lambda: craft.patch_wsit_entry(base(), 0, expert=2**32 - 1),
     E.InvalidDirectoryEntry, "wsit[0].expert", lambda b: wsit_off(b, 0, "expert"))
case("r20-layer-ge-num-layers", lambda: craft.patch_wsit_entry(craft.patch_wsit_entry(base(), 0, layer=1, fix=False),
                                                               1, layer=1), E.InvalidDirectoryEntry, "wsit[0].layer",
     lambda b: wsit_off(b, 0, "layer"))
case("r20-layer-not-constant", lambda: craft.patch_wsit_entry(base(), 1, layer=2**32 - 1), E.InvalidDirectoryEntry,
     "wsit[1].layer", lambda b: wsit_off(b, 1, "layer"))
case("r20-wsit-disagrees-with-metadata", lambda: craft.patch_wsit_entry(craft.patch_wsit_entry(
    base("two_layers"), 2, layer=0, fix=False), 3, layer=0), E.InvalidDirectoryEntry, "wsit[2].layer",
    lambda b: wsit_off(b, 2, "layer"))

# Row 21: type codes.
for v in (3, 4, 0xFFFF):
    case(f"r21-dense-dtype-{v}", lambda v=v: craft.patch_dense_entry(base(), 1, dtype=v), E.InvalidDirectoryEntry,
         "dense[1].dtype", lambda b: dense_off(b, 1, "dtype"))
case("r21-dense-dtype-vs-metadata", lambda: craft.patch_dense_entry(base(), 1, dtype=int(S.DType.BF16)),
     E.InvalidDirectoryEntry, "dense[1].dtype", lambda b: dense_off(b, 1, "dtype"))
for v in (7, 0xFFFF):
    case(f"r21-expert-format-{v}", lambda v=v: craft.patch_header(base(), expert_format=v), E.InvalidHeaderField,
         "expert_format", H("expert_format"))
# A code a newer minor version may define: said as a version problem. A 4-bit format in a file that says 1.0.
case("r21-expert-format-from-1.2", lambda: craft.patch_header(base(), expert_format=7, version_minor=2),
     E.UnsupportedVersion, "expert_format", H("expert_format"), message="a newer reader is needed")
for kind in ("int4", "mxfp4"):
    case(f"r21-{kind}-in-a-1.0-file", lambda kind=kind: craft.patch_header(base(kind), version_minor=0),
         E.InvalidHeaderField, "version_minor", H("version_minor"), message="defined from version 1.1")
# int4_group g32 and mxfp4 blobs have the same size at H = I = 32: only the metadata disagrees
case("r21-int4-read-as-mxfp4", lambda: craft.patch_header(base("int4"), expert_format=int(S.ExpertFormat.MXFP4)),
     E.InvalidMetadata, "quantization.experts", lambda b: craft.header_of(b).metadata_offset)
case("r21-expert-format-vs-metadata", lambda: craft.patch_header(base(), expert_format=int(S.ExpertFormat.F16),
                                                                  expert_blob_size=4096), E.InvalidMetadata,
     "quantization.experts", lambda b: craft.header_of(b).metadata_offset)

# Row 22: rank and dims (entry 0 is embed_tokens [16, 16] f16; entry 1 is layers.0.input_norm [16]).
for v in (0, 5, 0xFFFF):
    case(f"r22-rank-{v}", lambda v=v: craft.patch_dense_entry(base(), 0, rank=v), E.InvalidDirectoryEntry,
         "dense[0].rank", lambda b: dense_off(b, 0, "rank"))
for label, dims in (("dim0", (0, 16)), ("dim-over-cap", (S.MAX_DIM + 1, 16)), ("dim-2^63", (2**63, 16)),
                    ("dim-max", (2**64 - 1, 16)), ("unused-dim", (16, 16, 1))):
    case(f"r22-{label}", lambda dims=dims: craft.patch_dense_entry(base(), 0, shape=dims), E.InvalidDirectoryEntry,
         "dense[0].shape", lambda b: dense_off(b, 0, "shape"))
case("r22-product-huge", lambda: craft.patch_dense_entry(base(), 0, rank=4, shape=(S.MAX_DIM,) * 4),
     E.InvalidDirectoryEntry, "dense[0].size", lambda b: dense_off(b, 0, "size"))
case("r22-size-vs-shape", lambda: craft.patch_dense_entry(base(), 0, size=511), E.InvalidDirectoryEntry,
     "dense[0].size", lambda b: dense_off(b, 0, "size"))
case("r22-size-0", lambda: craft.patch_dense_entry(base(), 0, size=0), E.InvalidDirectoryEntry, "dense[0].size",
     lambda b: dense_off(b, 0, "size"))
# final_norm (the last tensor, tied embeddings) halved: the layout still holds, the model's list does not.
case("r22-shape-vs-model", lambda: craft.patch_dense_entry(base(), 8, shape=(8,), size=16),
     E.InvalidDirectoryEntry, "dense[8]", lambda b: craft.dense_entry_base(b, 8))
case("r13-dense-offset", lambda: craft.patch_dense_entry(base(), 1, offset=4096 + 512 + 256),
     E.LayoutError, "dense[1].offset", lambda b: dense_off(b, 1, "offset"))
case("r13-dense-offset-max", lambda: craft.patch_dense_entry(base(), 1, offset=2**64 - 1),
     E.LayoutError, "dense[1].offset", lambda b: dense_off(b, 1, "offset"))

# Names: non-ASCII, control characters, embedded NUL, empty, too long, duplicate, unknown.
for label, name in (("non-ascii", "layers.0.input_nörm".encode()), ("control", b"layers.0.\x01input_norm"),
                    ("embedded-nul", b"layers.0\x00input_norm"), ("empty", b""), ("space", b"final norm"),
                    ("slash", b"../final_norm"), ("no-nul-128", b"a" * 128)):
    case(f"name-{label}", lambda name=name: craft.patch_dense_entry(base(), 1, name=name), E.InvalidDirectoryEntry,
         "dense[1].name", lambda b: dense_off(b, 1, "name"))
case("name-duplicate", lambda: craft.patch_dense_entry(base(), 8, name=b"layers.0.input_norm"),
     E.InvalidDirectoryEntry, "dense[8].name", lambda b: dense_off(b, 8, "name"), message="duplicate")
case("name-unknown", lambda: craft.patch_dense_entry(base(), 8, name=b"lm_head_extra"), E.InvalidDirectoryEntry,
     "dense[8]", lambda b: craft.dense_entry_base(b, 8))

# Row 32/33: declared size vs real size, trailing bytes.
case("r32-declared-larger", lambda: craft.patch_header(base(), file_size=len(base()) + 1), E.TruncatedFile,
     "file_size", H("file_size"))
case("r32-declared-smaller", lambda: craft.patch_header(base(), file_size=len(base()) - 1), E.SizeMismatch,
     "file_size", H("file_size"))
case("r32-declared-max", lambda: craft.patch_header(base(), file_size=2**64 - 1), E.TruncatedFile, "file_size",
     H("file_size"))
case("r33-trailing-byte", lambda: base() + b"\0", E.SizeMismatch, "file_size", H("file_size"))
case("r33-trailing-declared", lambda: craft.patch_header(base() + bytes(4096), file_size=len(base()) + 4096),
     E.LayoutError, "wsit_size", H("wsit_size"))
for cut in (512, 4096, 8192, 16384, 17280, 19071):
    case(f"truncated-at-{cut}", lambda cut=cut: base()[:cut], E.TruncatedFile, "file_size", H("file_size"))

# Section checksums (a bit flipped inside each section, nothing re-sealed).
for sec, field in (("metadata", "metadata_checksum"), ("dense_dir", "dense_dir_checksum"),
                   ("wsit", "wsit_checksum")):
    def _flip(sec=sec):
        buf = base()
        pos = getattr(craft.header_of(buf), f"{sec}_offset") + 5
        buf[pos] ^= 0x10
        return buf
    case(f"section-{sec}-bitflip", _flip, E.CorruptSection, field, lambda b, sec=sec: getattr(craft.header_of(b),
                                                                                            f"{sec}_offset"))

# Rows 25-30: metadata (re-sealed and moved with rewrite_metadata).
MO = lambda b: craft.header_of(b).metadata_offset  # noqa: E731


def _bad_utf8():
    raw = craft.metadata_bytes(base())
    i = raw.index(b'"synthetic"') + 1
    return with_meta(base(), raw[:i] + b"\xff" + raw[i + 1:])


case("r25-invalid-utf8", _bad_utf8, E.InvalidMetadata, "metadata",
     lambda b: MO(b) + craft.metadata_bytes(b).index(b"\xff"), message="UTF-8")
case("r25-invalid-json", lambda: with_meta(base(), craft.metadata_bytes(base())[:-1]), E.InvalidMetadata,
     "metadata", MO, message="JSON")
case("r25-lone-surrogate", lambda: with_meta(base(), craft.metadata_bytes(base()).replace(
    b'"synthetic"', b'"\\ud800\\u001b[31m"')), E.InvalidMetadata, "metadata", MO, message="surrogate")
case("r25-lone-surrogate-key", lambda: with_meta(base(), craft.metadata_bytes(base())[:-1] + b',"\\udfff":1}'),
     E.InvalidMetadata, "metadata", MO, message="surrogate")
case("r25-not-an-object", lambda: with_meta(base(), b"[]"), E.InvalidMetadata, "metadata", MO)
case("r25-utf8-bom", lambda: with_meta(base(), b"\xef\xbb\xbf" + craft.metadata_bytes(base())), E.InvalidMetadata,
     "metadata", MO)
case("r26-duplicate-key", lambda: with_meta(base(), b'{"format":"colibri",' + craft.metadata_bytes(base())[1:]),
     E.InvalidMetadata, "metadata", MO, message="duplicate")
case("r27-depth-1000", lambda: with_meta(base(), craft.metadata_bytes(base())[:-1] + b',"x":' + b"[" * 1000 +
                                         b"]" * 1000 + b"}"), E.InvalidMetadata, "metadata", MO, message="deep")
case("r27-depth-17", lambda: edit_meta(base(), lambda m: m["provenance"].__setitem__("x", functools.reduce(
    lambda acc, _: [acc], range(14), []))), E.InvalidMetadata, "metadata", MO, message="deep")
case("r27-nan", lambda: with_meta(base(), craft.metadata_bytes(base()).replace(b'"rms_norm_eps":1e-05',
                                                                                b'"rms_norm_eps":NaN')),
     E.InvalidMetadata, "metadata", MO, message="NaN")
case("r27-overflow-to-inf", lambda: with_meta(base(), craft.metadata_bytes(base()).replace(
    b'"rms_norm_eps":1e-05', b'"rms_norm_eps":1e999')), E.InvalidMetadata, "metadata", MO)
case("r27-huge-int", lambda: edit_meta(base(), lambda m: m["model"].__setitem__("rms_norm_eps", 10**400)),
     E.InvalidMetadata, "model.rms_norm_eps", MO)
case("r27-too-many-digits", lambda: with_meta(base(), craft.metadata_bytes(base()).replace(
    b'"rms_norm_eps":1e-05', b'"rms_norm_eps":' + b"9" * 5000)), E.InvalidMetadata, "metadata", MO)
for label, path, value, field in (
        ("num-experts-str", ("model", "num_experts"), "8", "model.num_experts"),
        ("num-experts-bool", ("model", "num_experts"), True, "model.num_experts"),
        ("num-experts-float", ("model", "num_experts"), 2.0, "model.num_experts"),
        ("top-k-null", ("model", "top_k"), None, "model.top_k"),
        ("rope-list", ("model", "rope"), [], "model.rope"),
        ("router-scale-str", ("model", "router", "scale"), "1", "model.router.scale"),
        ("qk-norm-unknown", ("model", "qk_norm"), "rms", "model.qk_norm"),
        ("moe-layers-str", ("model", "moe_layers"), "0", "model.moe_layers"),
        ("dense-dtype-int8", ("quantization", "dense_dtype"), "int8", "quantization.dense_dtype"),
        ("format-name", ("format",), "gguf", "format")):
    def _set(m, path=path, value=value):
        node = m
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    case(f"r28-{label}", lambda _set=_set: edit_meta(base(), _set), E.InvalidMetadata, field, MO)
for label, key, value in (("num-experts", "num_experts", 3), ("hidden", "hidden_size", 32),
                          ("top-k", "top_k", 2), ("layers", "num_layers", 2),
                          ("expert-inter", "expert_intermediate_size", 32)):
    def _set(m, key=key, value=value):
        m["model"][key] = value
        if key == "num_layers":
            m["model"]["dense_intermediate_size"] = 64
    case(f"r29-{label}", lambda _set=_set: edit_meta(base(), _set), E.InvalidMetadata, f"model.{key}", MO,
         message="disagrees")
case("r29-vocab", lambda: edit_meta(base(), lambda m: m["model"].__setitem__("vocab_size", 32)),
     E.InvalidDirectoryEntry, "dense[0]", lambda b: craft.dense_entry_base(b, 0))
case("r29-experts-format", lambda: edit_meta(base(), lambda m: m["quantization"].__setitem__("experts", "float16")),
     E.InvalidMetadata, "quantization.experts", MO)
case("r29-group-size", lambda: edit_meta(base("group"), lambda m: m["quantization"].__setitem__("group_size", 32)),
     E.InvalidMetadata, "quantization.group_size", MO)
for label, path in (("model-rope", ("model", "rope")), ("format", ("format",)), ("model", ("model",)),
                    ("quantization", ("quantization",)), ("router-bias", ("model", "router", "bias"))):
    def _drop(m, path=path):
        node = m
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    case(f"missing-{label}", lambda _drop=_drop: edit_meta(base(), _drop), E.InvalidMetadata, path[-1], MO)


# Data-level faults: tables are fine, `validate` and first use catch them.
def _blob_byte(k, pos, fix_checksum, kind="small"):
    def build():
        buf = base(kind)
        e = craft.read_wsit_entry(buf, k)
        buf[e["offset"] + pos] ^= 0x01
        if fix_checksum:
            craft.fix_expert_checksum(buf, k)
        return buf
    return build


def _blob_pos(k, pos):
    return lambda b: craft.read_wsit_entry(b, k)["offset"] + pos


def _dense_first_byte(k):
    """Flip a bit of dense tensor k's first byte (its checksum left stale)."""
    def build():
        buf = base()
        buf[craft.read_dense_entry(buf, k)["offset"]] ^= 0x01
        return buf
    return build


def _set_byte(pos_fn, value=0x01):
    def build():
        buf = base()
        buf[pos_fn(buf)] = value
        return buf
    return build


case("r23-corrupt-expert", _blob_byte(1, 0, False), E.CorruptExpert, "expert[0,1]", _blob_pos(1, 0), stage="data")
case("r23-corrupt-dense", _dense_first_byte(0), E.CorruptTensor, "embed_tokens",
     lambda b: craft.read_dense_entry(b, 0)["offset"], stage="data")


def _swap_blobs():
    """Expert 0's bytes and checksum moved to expert 1's slot and back: each checksum valid for its own bytes."""
    buf = base()
    e0, e1 = craft.read_wsit_entry(buf, 0), craft.read_wsit_entry(buf, 1)
    b0 = bytes(buf[e0["offset"]:e0["offset"] + e0["size"]])
    b1 = bytes(buf[e1["offset"]:e1["offset"] + e1["size"]])
    assert b0 != b1
    buf[e0["offset"]:e0["offset"] + e0["size"]] = b1
    buf[e1["offset"]:e1["offset"] + e1["size"]] = b0
    craft.patch_wsit_entry(buf, 0, checksum=e1["checksum"], fix=False)
    craft.patch_wsit_entry(buf, 1, checksum=e0["checksum"])
    return buf


def _swap_dense():
    """input_norm and post_attn_norm ([16] f16 each) swapped with their checksums."""
    buf = base()
    names = [craft.read_dense_entry(buf, k)["name"] for k in range(craft.header_of(buf).num_dense_tensors)]
    i, j = names.index("layers.0.input_norm"), names.index("layers.0.post_attn_norm")
    a, b = craft.read_dense_entry(buf, i), craft.read_dense_entry(buf, j)
    da, db = bytes(buf[a["offset"]:a["offset"] + a["size"]]), bytes(buf[b["offset"]:b["offset"] + b["size"]])
    buf[a["offset"]:a["offset"] + a["size"]], buf[b["offset"]:b["offset"] + b["size"]] = db, da
    craft.patch_dense_entry(buf, i, checksum=b["checksum"], fix=False)
    craft.patch_dense_entry(buf, j, checksum=a["checksum"])
    return buf


case("r24-blobs-swapped", _swap_blobs, E.CorruptExpert, "expert[0,0]", _blob_pos(0, 0), stage="data")
case("r24-dense-swapped", _swap_dense, E.CorruptTensor, "layers.0.input_norm",
     lambda b: craft.read_dense_entry(b, 1)["offset"], stage="data")

# Row 5 (padding): every must-be-zero region, with the covering checksum re-sealed where there is one.
case("pad-header-to-data", _set_byte(lambda b: 600), E.NonZeroPadding, "padding", 600, stage="data")
case("pad-header-to-data-last", _set_byte(lambda b: 4095, 0x80), E.NonZeroPadding, "padding", 4095, stage="data")
case("pad-between-dense", _set_byte(lambda b: craft.read_dense_entry(b, 1)["offset"] + 32), E.NonZeroPadding,
     "padding", lambda b: craft.read_dense_entry(b, 1)["offset"] + 32, stage="data")
case("pad-dense-to-experts", _set_byte(lambda b: craft.header_of(b).experts_offset - 1), E.NonZeroPadding,
     "padding", lambda b: craft.header_of(b).experts_offset - 1, stage="data")
case("pad-metadata-to-directory", _set_byte(lambda b: craft.header_of(b).dense_dir_offset - 1), E.NonZeroPadding,
     "padding", lambda b: craft.header_of(b).dense_dir_offset - 1, stage="data")
# Inside a blob (int8_row, H = I = 16): gate_up [0,512) scale [512,640) pad [640,768) down [768,1024)
# scale [1024,1088) then zero tail to 4096.
for label, pos in (("blob-between-arrays", 700), ("blob-tail-first", 1088), ("blob-tail-last", 4095)):
    case(f"pad-{label}", _blob_byte(1, pos, True), E.NonZeroPadding, "expert[0,1] padding", _blob_pos(1, pos),
         stage="data")
# 4-bit blobs (H = I = 32, g 32): gate_up [64, 16] bytes [0,1024), scale [64, 1] [1024,1152) f16 or [1024,1088)
# e8m0, pad to 1280, down [32, 16] [1280,1792), scale [1792,1856) or [1792,1824), zero tail to 4096.
for kind, between, tail in (("int4", 1152, 1856), ("mxfp4", 1088, 1824)):
    for label, pos in (("between-arrays", between), ("before-down", 1279), ("tail-first", tail),
                       ("tail-last", 4095)):
        case(f"pad-{kind}-blob-{label}", _blob_byte(1, pos, True, kind), E.NonZeroPadding, "expert[0,1] padding",
             _blob_pos(1, pos), stage="data")
    for label, pos in (("values", 5), ("scale", 1024), ("down", 1300), ("down-scale", 1792)):
        case(f"r23-corrupt-{kind}-expert-{label}", _blob_byte(1, pos, False, kind), E.CorruptExpert, "expert[0,1]",
             _blob_pos(1, 0), stage="data")     # a checksum names its blob's offset


# --- running the cases ----------------------------------------------------------------------------------
def _expected_offset(c: Case, buf) -> int | None:
    return c.offset(buf) if callable(c.offset) else c.offset


def _check_exc(c: Case, exc: E.ColibriFormatError, buf) -> None:
    assert type(exc) is c.exc, f"{c.id}: got {type(exc).__name__}: {exc}"
    assert exc.field is not None and c.field in exc.field, f"{c.id}: field {exc.field!r}"
    assert f"field={exc.field}" in str(exc)
    if c.message:
        assert c.message in str(exc), str(exc)
    assert isinstance(exc.offset, int), f"{c.id}: offset {exc.offset!r}"
    assert 0 <= exc.offset <= max(len(buf), S.HEADER_SIZE)
    expected = _expected_offset(c, buf)
    if expected is not None:
        assert exc.offset == expected, f"{c.id}: offset {exc.offset} != {expected}"


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path: Path, capsys) -> None:
    buf = c.build()
    path = craft.write(tmp_path / f"{c.id}.colibri", buf)
    if c.stage == "open":
        for call in (load_tables, colibri_format.open, inspect_file):
            with pytest.raises(E.ColibriFormatError) as info:
                call(path)
            _check_exc(c, info.value, buf)
    else:
        load_tables(path)                                   # the tables are valid
    report = validate_file(path)
    assert not report.valid
    fault = report.faults[0]
    assert fault.error == c.exc.__name__, (c.id, report.faults)
    assert c.field in fault.field and isinstance(fault.offset, int)
    if c.stage == "data":
        # one fault of the expected class (a re-sealed padding byte must not also fail a checksum)
        assert {f.error for f in report.faults} == {c.exc.__name__}, report.faults
        expected = _expected_offset(c, buf)
        assert expected is None or fault.offset == expected, (fault.offset, expected)
    assert cli_main(["validate", path]) == 1
    assert cli_main(["validate", "--json", path]) == 1
    assert cli_main(["inspect", path]) == 1 if c.stage == "open" else cli_main(["inspect", path]) == 0
    capsys.readouterr()


def test_catalogue_rows_covered() -> None:
    rows = {c.id.split("-")[0] for c in CASES}
    for row in [f"r{n}" for n in (1, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,
                                  26, 27, 28, 29, 30, 32, 33)]:
        assert row in rows, row


def test_every_case_is_distinct() -> None:
    blobs = {}
    for c in CASES:
        data = bytes(c.build())
        assert data not in blobs, f"{c.id} builds the same bytes as {blobs.get(data)}"
        blobs[data] = c.id


# --- row 2: paths that are not regular files ------------------------------------------------------------
def _not_regular(path: str) -> None:
    for call in (load_tables, colibri_format.open, inspect_file, validate_file):
        with pytest.raises(E.NotARegularFile) as info:
            call(path)
        assert info.value.field == "path" and "field=path" in str(info.value)
    assert cli_main(["validate", path]) == 2
    assert cli_main(["inspect", path]) == 2


def test_directory(tmp_path: Path, capsys) -> None:
    _not_regular(str(tmp_path))
    capsys.readouterr()


@pytest.mark.timeout(10)
def test_fifo_does_not_hang(tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "pipe.colibri"
    os.mkfifo(fifo)
    _not_regular(str(fifo))         # nobody writes to it: a blocking open or read would hang here
    capsys.readouterr()


@pytest.mark.timeout(10)
def test_dev_zero(capsys) -> None:
    if not os.access("/dev/zero", os.R_OK):
        pytest.skip("/dev/zero is not readable on this machine")
    _not_regular("/dev/zero")
    capsys.readouterr()


@pytest.mark.parametrize("path", ["/proc/self/mem", "/proc/self/status", "/sys/kernel/mm/transparent_hugepage/enabled"])
def test_kernel_pseudo_files(path: str, capsys) -> None:
    """Regular files to stat, kernel views to read: a size of 0 (or 4096) that lies, reads that fail."""
    if not os.access(path, os.R_OK):
        pytest.skip(f"{path} is not readable on this machine")
    _not_regular(path)
    capsys.readouterr()


def test_empty_and_sparse_files_are_invalid_not_unreadable(tmp_path: Path, capsys) -> None:
    """No blocks on disk, like a pseudo-file, but a real file: its contents are judged."""
    empty = tmp_path / "empty.colibri"
    empty.touch()
    with pytest.raises(E.TruncatedFile):
        load_tables(empty)
    sparse = tmp_path / "sparse.colibri"
    with open(sparse, "wb") as f:
        f.truncate(1 << 16)                                 # a hole: zeros, no blocks
    with pytest.raises(E.BadMagic):
        load_tables(sparse)
    assert not validate_file(sparse).valid
    assert cli_main(["validate", str(empty)]) == 1 and cli_main(["inspect", str(sparse)]) == 1
    capsys.readouterr()


def test_missing_and_dangling(tmp_path: Path, capsys) -> None:
    _not_regular(str(tmp_path / "absent.colibri"))
    os.symlink(tmp_path / "absent.colibri", tmp_path / "dangling.colibri")
    _not_regular(str(tmp_path / "dangling.colibri"))
    os.symlink(tmp_path, tmp_path / "to-dir.colibri")
    _not_regular(str(tmp_path / "to-dir.colibri"))
    capsys.readouterr()


def test_symlink_to_valid_file_is_allowed(tmp_path: Path, capsys) -> None:
    real = craft.write(tmp_path / "real.colibri", base())
    os.symlink(real, tmp_path / "link.colibri")
    link = str(tmp_path / "link.colibri")
    assert validate_file(link).valid
    assert inspect_file(link)["file_size"] == len(base())
    with colibri_format.open(link) as f:
        assert f.dense("final_norm").shape == (16,)
    assert cli_main(["validate", link]) == 0
    capsys.readouterr()


def test_base_files_are_valid(tmp_path: Path) -> None:
    for kind in ("small", "two_layers", "group", "int4", "mxfp4"):
        path = craft.write(tmp_path / f"{kind}.colibri", base(kind))
        report = validate_file(path)
        assert report.valid, report.faults


def test_minor_version_is_accepted(tmp_path: Path) -> None:
    """Minor versions only add metadata keys: a 1.7 file is read by a 1.0 reader."""
    path = craft.write(tmp_path / "minor.colibri", craft.patch_header(base(), version_minor=7))
    assert validate_file(path).valid
    path = craft.write(tmp_path / "extra-key.colibri", edit_meta(base(), lambda m: m.__setitem__("future", {"a": 1})))
    assert validate_file(path).valid


def test_depth_cap_is_exact(tmp_path: Path) -> None:
    """Depth 16 (the cap) is read; 17 is refused (case r27-depth-17)."""
    nested = functools.reduce(lambda acc, _: [acc], range(13), [])    # root 1, provenance 2, 14 lists: 3..16
    path = craft.write(tmp_path / "d16.colibri", edit_meta(base(), lambda m: m["provenance"].__setitem__("x", nested)))
    assert validate_file(path).valid


# --- row 23: verify policies ----------------------------------------------------------------------------
def test_corrupt_expert_on_first_use_not_with_never(tmp_path: Path) -> None:
    """verify="first-use" (default) refuses a corrupt blob on the first access; verify="never" hands out the
    bytes unchecked (documented: for callers that ran `colibri validate` beforehand)."""
    path = craft.write(tmp_path / "corrupt.colibri", _blob_byte(1, 0, False)())
    with colibri_format.open(path) as f:
        f.expert(0, 0)                                   # the intact expert is fine
        with pytest.raises(E.CorruptExpert) as info:
            f.expert(0, 1)
        assert info.value.field == "expert[0,1]" and info.value.offset == f.blob_offset(0, 1)
        with pytest.raises(E.CorruptExpert):
            f.expert_blob(0, 1)                          # still refused: a failed check is not remembered as done
        with pytest.raises(E.CorruptExpert):
            f.expert_f32(0, 1)
    with colibri_format.open(path, verify="always") as f:
        with pytest.raises(E.CorruptExpert):
            f.expert(0, 1)
    with colibri_format.open(path, verify="never") as f:
        view = f.expert(0, 1)                           # no check: the corrupt bytes come back
        assert view.gate_up.shape == (32, 16)
        with pytest.raises(E.CorruptExpert):
            f.verify_expert(0, 1)                        # an explicit check still catches it


def test_corrupt_dense_on_first_use(tmp_path: Path) -> None:
    path = craft.write(tmp_path / "corrupt.colibri", _dense_first_byte(0)())
    with colibri_format.open(path) as f:
        with pytest.raises(E.CorruptTensor) as info:
            f.dense("embed_tokens")
        assert info.value.field == "embed_tokens"
        f.dense("final_norm")
    with colibri_format.open(path, verify="never") as f:
        assert f.dense("embed_tokens").shape == (16, 16)


def test_bad_verify_policy_and_names(tmp_path: Path) -> None:
    path = craft.write(tmp_path / "ok.colibri", base())
    with pytest.raises(E.InvalidInput):
        colibri_format.open(path, verify="sometimes")
    with colibri_format.open(path) as f:
        with pytest.raises(E.InvalidInput):
            f.dense("no.such.tensor")
        with pytest.raises(E.InvalidInput):
            f.expert(0, 2)
        with pytest.raises(E.InvalidInput):
            f.expert(5, 0)
        with pytest.raises(E.InvalidInput):
            f.expert(0, -1)

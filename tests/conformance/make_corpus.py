"""Write the `.colibri` v1 conformance corpus (deterministic: the same bytes on every run).

    python -m tests.conformance.make_corpus [--out DIR]      # default: tests/conformance/corpus

Valid files come with `<name>.inspect.json` (what `colibri inspect --json` prints, without "path").
Invalid files are named `bad_<ErrorClass>_<case>.colibri`; `manifest.json` lists every file with what a
reader must do with it. See tests/conformance/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


from colibri_format import spec as S
from colibri_format.inspect import inspect_file
from colibri_format.synthetic import synthetic_model, write_synthetic
from tests.spec import craft

DEFAULT_OUT = Path(__file__).resolve().parent / "corpus"

BASE = dict(vocab=32, hidden=32, layers=2, heads=2, kv_heads=1, experts=4, top_k=2, expert_inter=32)

# name -> (model kwargs, write_synthetic kwargs, description)
VALID = {
    "int8_row": (BASE, dict(expert_format=S.ExpertFormat.INT8_ROW, dense_dtype=S.DType.F16, seed=1),
                 "int8 experts with one float32 scale per row, float16 dense tensors"),
    "int8_group": (BASE, dict(expert_format=S.ExpertFormat.INT8_GROUP, group_size=16, dense_dtype=S.DType.F32,
                              seed=2), "int8 experts with a float32 scale per 16 inputs, float32 dense tensors"),
    "float16": (dict(BASE, experts=2), dict(expert_format=S.ExpertFormat.F16, dense_dtype=S.DType.F16, seed=3),
                "float16 experts and dense tensors"),
    "float32": (dict(BASE, layers=1, experts=2, hidden=16, expert_inter=16),
                dict(expert_format=S.ExpertFormat.F32, dense_dtype=S.DType.F32, seed=4),
                "float32 experts and dense tensors"),
    "bf16_dense": (dict(BASE, experts=2), dict(expert_format=S.ExpertFormat.BF16, dense_dtype=S.DType.BF16, seed=5),
                   "bfloat16 experts and dense tensors (stored as uint16 bit patterns)"),
    "tied_embeddings": (dict(BASE, tie=True), dict(expert_format=S.ExpertFormat.INT8_ROW, dense_dtype=S.DType.F16,
                                                  seed=6), "tie_word_embeddings: no lm_head tensor"),
    "dense_layer_shared_expert": (dict(BASE, layers=3, dense_layers=(0,), shared=16, qk_norm="per_head"),
                                  dict(expert_format=S.ExpertFormat.INT8_ROW, dense_dtype=S.DType.F16, seed=7),
                                  "layer 0 is a dense MLP, layers 1-2 are MoE with a sigmoid-gated shared expert "
                                  "and per-head q/k norms"),
    "int4_group": (dict(BASE, hidden=64, expert_inter=64, heads=4, kv_heads=2),
                   dict(expert_format=S.ExpertFormat.INT4_GROUP, group_size=64, dense_dtype=S.DType.F16, seed=9),
                   "v1.1: int4 experts (two signed 4-bit values a byte, low nibble first) with a float16 scale per "
                   "64 inputs"),
    "mxfp4": (BASE, dict(expert_format=S.ExpertFormat.MXFP4, group_size=32, dense_dtype=S.DType.BF16, seed=10),
              "v1.1: MXFP4 experts (FP4 E2M1 pairs, low nibble first, one E8M0 scale per 32 inputs)"),
}

# The base of the invalid files: small, int8_row, two experts whose blobs differ.
BAD_BASE = dict(vocab=16, hidden=16, layers=1, heads=2, kv_heads=1, experts=2, top_k=1, expert_inter=16, tie=True)


def _bad_cases(base: bytes) -> dict[str, tuple[bytearray, str, str, str]]:
    """file stem -> (bytes, expected error class, field our reader names, what is wrong)."""
    b = lambda: bytearray(base)  # noqa: E731
    h = craft.header_of(base)
    out = {}

    def add(cls, case, buf, field, what):
        out[f"bad_{cls}_{case}"] = (buf, cls, field, what)

    add("TruncatedFile", "cut_in_wsit", b()[:len(base) - 16], "file_size",
        "the last 16 bytes are missing (header file_size is larger than the file)")
    add("BadMagic", "gguf", bytearray(b"GGUF\x03\x00\x00\x00") + b()[8:], "magic", "a GGUF magic")
    add("UnsupportedVersion", "byte_swapped", craft.patch_header(b(), version_major=0x0100), "version_major",
        "version_major 256: a big-endian writer")
    add("UnsupportedVersion", "expert_format_from_v1_2", craft.patch_header(b(), version_minor=2, expert_format=7),
        "expert_format", "expert_format 7 in a file that says version 1.2: a code this 1.1 reader does not define")
    add("CorruptHeader", "checksum", craft.patch_header(b(), fix=False, num_layers=2), "header_checksum",
        "num_layers changed without updating the header checksum")
    add("InvalidHeaderField", "num_experts_zero", craft.patch_header(b(), num_experts=0, wsit_size=0), "num_experts",
        "num_experts 0 (header re-sealed)")
    add("LayoutError", "metadata_offset", craft.patch_header(b(), metadata_offset=h.metadata_offset + 64),
        "metadata_offset", "metadata does not start right after the last blob")
    add("SizeMismatch", "trailing_byte", b() + b"\0", "file_size", "one byte after the WSIT")
    dir_flip = b()
    dir_flip[h.dense_dir_offset + 3] ^= 0x04
    add("CorruptSection", "dense_dir", dir_flip, "dense_dir_checksum", "a bit flipped in a tensor name")
    add("InvalidDirectoryEntry", "duplicate_expert", craft.patch_wsit_entry(b(), 1, expert=0), "wsit[1].expert",
        "two WSIT entries for (layer 0, expert 0) (WSIT re-sealed)")
    add("InvalidMetadata", "duplicate_key",
        craft.rewrite_metadata(b(), b'{"format":"colibri",' + craft.metadata_bytes(base)[1:]), "metadata",
        'the key "format" appears twice (metadata re-sealed)')
    tensor = b()
    e0 = craft.read_dense_entry(tensor, 0)
    tensor[e0["offset"] + 7] ^= 0x20
    add("CorruptTensor", "embed_tokens", tensor, "embed_tokens", "a bit flipped in embed_tokens")
    swapped = b()
    w0, w1 = craft.read_wsit_entry(swapped, 0), craft.read_wsit_entry(swapped, 1)
    blob0 = bytes(swapped[w0["offset"]:w0["offset"] + w0["size"]])
    swapped[w0["offset"]:w0["offset"] + w0["size"]] = swapped[w1["offset"]:w1["offset"] + w1["size"]]
    swapped[w1["offset"]:w1["offset"] + w1["size"]] = blob0
    craft.patch_wsit_entry(swapped, 0, checksum=w1["checksum"], fix=False)
    craft.patch_wsit_entry(swapped, 1, checksum=w0["checksum"])
    add("CorruptExpert", "blobs_swapped", swapped, "expert[0,0]",
        "experts 0 and 1 swapped with their checksums: each checksum matches its bytes but not its slot")
    pad = b()
    pad[w1["offset"] + w1["size"] - 1] = 0x01
    craft.fix_expert_checksum(pad, 1)
    add("NonZeroPadding", "blob_tail", pad, "expert[0,1] padding",
        "the last byte of expert 1's blob is not zero (its checksum re-sealed)")
    return out


def _bad_4bit_cases(base: bytes) -> dict[str, tuple[bytearray, str, str, str]]:
    """Faults of the v1.1 formats, on an int4_group file (H = I = 32, group 32)."""
    w1 = craft.read_wsit_entry(base, 1)
    pad = bytearray(base)
    pad[w1["offset"] + 1200] = 0x10          # between gate_up_scale [1024, 1152) and down at 1280
    craft.fix_expert_checksum(pad, 1)
    return {
        "bad_InvalidHeaderField_int4_in_v1_0": (
            craft.patch_header(bytearray(base), version_minor=0), "InvalidHeaderField", "version_minor",
            "int4_group experts in a file whose header says version 1.0 (header re-sealed)"),
        "bad_InvalidHeaderField_int4_group_size_16": (
            craft.patch_header(bytearray(base), group_size=16), "InvalidHeaderField", "group_size",
            "int4_group with group_size 16 (int4_group takes 32, 64 or 128; header re-sealed)"),
        "bad_InvalidMetadata_int4_read_as_mxfp4": (
            craft.patch_header(bytearray(base), expert_format=int(S.ExpertFormat.MXFP4)), "InvalidMetadata",
            "quantization.experts", "the header says mxfp4 (same blob size here), the metadata int4_group"),
        "bad_NonZeroPadding_int4_blob_between_arrays": (
            pad, "NonZeroPadding", "expert[0,1] padding",
            "a non-zero byte between gate_up_scale and down in expert 1's int4 blob (its checksum re-sealed)"),
    }


# Faults only a full validation (not the table checks at open) finds.
DATA_CLASSES = {"CorruptTensor", "CorruptExpert", "NonZeroPadding"}


def inspect_json(path: Path) -> dict:
    info = inspect_file(path)
    info.pop("path")
    return info


def _dump(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def build(out: Path) -> list[Path]:
    """Write the corpus into `out` (created if needed); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    manifest = {"format": "colibri", "spec_version": f"{S.VERSION_MAJOR}.{S.VERSION_MINOR}", "valid": {},
                "invalid": {}}
    for name, (model_kw, write_kw, what) in VALID.items():
        path = out / f"{name}.colibri"
        write_synthetic(path, synthetic_model(**model_kw), **write_kw)
        (out / f"{name}.inspect.json").write_text(_dump(inspect_json(path)))
        manifest["valid"][path.name] = {"inspect": f"{name}.inspect.json", "description": what}
        written += [path, out / f"{name}.inspect.json"]
    with tempfile.TemporaryDirectory() as d:
        base_path = write_synthetic(Path(d) / "base.colibri", synthetic_model(**BAD_BASE),
                                    expert_format=S.ExpertFormat.INT8_ROW, dense_dtype=S.DType.F16, seed=8)
        base = Path(base_path).read_bytes()
        base4_path = write_synthetic(Path(d) / "base4.colibri", synthetic_model(**craft.SMALL_4BIT_MODEL),
                                     expert_format=S.ExpertFormat.INT4_GROUP, group_size=32, dense_dtype=S.DType.F16,
                                     seed=11)
        base4 = Path(base4_path).read_bytes()
    for stem, (data, cls, field, what) in {**_bad_cases(base), **_bad_4bit_cases(base4)}.items():
        path = out / f"{stem}.colibri"
        path.write_bytes(bytes(data))
        manifest["invalid"][path.name] = {"error": cls, "field": field,
                                          "detected_by": "validate" if cls in DATA_CLASSES else "open",
                                          "description": what}
        written.append(path)
    (out / "manifest.json").write_text(_dump(manifest))
    written.append(out / "manifest.json")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    files = build(args.out)
    total = sum(p.stat().st_size for p in files)
    print(f"wrote {len(files)} files, {total:,} bytes, to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

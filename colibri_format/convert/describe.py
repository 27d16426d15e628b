"""What a conversion records about itself: the file's metadata, the tokenizer, and the journal fingerprint.

The metadata holds no timestamps and no absolute paths, so the same input and options give the same bytes.
The fingerprint ties a resume journal to its inputs (config, index, every shard's name, size, mtime and
safetensors header, the tokenizer files) and to the options; a resume with any of them changed is refused.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import xxhash

from colibri_format import __version__
from colibri_format import spec as S
from colibri_format.convert import tokenizer_files
from colibri_format.convert.safe_paths import resolve_member

SAFETENSORS_HEADER_MAX = 100 << 20
JOURNAL_FORMAT = "colibri-convert-journal/1"


# --- tokenizer ------------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def read_tokenizer(root: Path, vocab_size: int | None = None) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The metadata `tokenizer` object (read by `tokenizer_files.read_tokenizer`, the one reader of these
    files) and the XXH3 of each tokenizer file present, which ties a resumable job to them."""
    tokenizer = tokenizer_files.read_tokenizer(root, vocab_size=vocab_size)
    hashes = {}
    for name in TOKENIZER_FILES:
        raw = tokenizer_files.read_file(root, name)
        if raw is not None:
            hashes[name] = xxhash.xxh3_64_hexdigest(raw)
    return tokenizer, hashes


# --- metadata -------------------------------------------------------------------------------------
def quantization_block(expert_format: S.ExpertFormat, dense_dtype: str, group_size: int,
                       per_expert: list[list[Any]] | None) -> dict[str, Any]:
    quantized = expert_format in S.QUANTIZED_FORMATS
    block: dict[str, Any] = {"experts": S.EXPERT_FORMAT_NAMES[expert_format],
                             "bits": S.EXPERT_FORMAT_BITS[S.ExpertFormat(expert_format)] if quantized else None,
                             "group_size": group_size or None, "dense_dtype": dense_dtype, "error": None}
    if quantized and per_expert:
        block["error"] = {"max_rel": max(row[2] for row in per_expert),
                          "mean_rel": sum(row[3] for row in per_expert) / len(per_expert),
                          "per_expert": per_expert}
    return block


MAX_LISTED_NAMES = 1000  # per group of skipped tensors; the count is always exact


def _names(names: list[str]) -> dict[str, Any]:
    return {"count": len(names), "names": sorted(names)[:MAX_LISTED_NAMES]}


def provenance(src: Any, skipped: dict[str, str] | None = None, unused: list[str] | None = None,
               source_quantization: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where the file came from. `skipped`: checkpoint tensors left out on purpose (name -> reason), listed
    by reason; `unused`: tensors nothing used, accepted with allow_unused_tensors; `source_quantization`: how a
    pre-quantized source's values were read (pack-quantized int4, convert/derived.py::packed_provenance), when
    there is something to say."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in (skipped or {}).items():
        by_reason.setdefault(reason, []).append(name)
    out = {"source_format": src.source_format,
           "source_files": [{"name": f.name, "size": f.size} for f in src.files],
           "config_xxh3": src.config_xxh3, "index_xxh3": src.index_xxh3,
           "skipped_tensors": [{"reason": reason, **_names(names)} for reason, names in sorted(by_reason.items())],
           "unused_tensors": _names(list(unused or [])),
           "tool": "colibri-format", "tool_version": __version__}
    if source_quantization is not None:
        out["source_quantization"] = source_quantization
    return out


def build_metadata(*, architecture: str, model: dict[str, Any], quantization: dict[str, Any],
                   provenance_block: dict[str, Any], tokenizer: dict[str, Any] | None) -> dict[str, Any]:
    minor = S.minor_version_for(S.EXPERT_FORMAT_BY_NAME[quantization["experts"]])
    return {"format": "colibri", "spec_version": f"{S.VERSION_MAJOR}.{minor}",
            "architecture": architecture, "model": model, "quantization": quantization,
            "provenance": provenance_block, "tokenizer": tokenizer}


# --- journal fingerprint --------------------------------------------------------------------------
def _safetensors_header_xxh3(path: Path) -> str | None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return None
            (n,) = struct.unpack("<Q", head)
            return xxhash.xxh3_64_hexdigest(fh.read(min(n, SAFETENSORS_HEADER_MAX)))
    except OSError:
        return None


def input_fingerprint(src: Any, tokenizer_hashes: dict[str, str]) -> dict[str, Any]:
    files = []
    for f in src.files:
        path = resolve_member(Path(src.root), f.name, field=f.name)
        st = os.stat(path)
        header = _safetensors_header_xxh3(path) if f.name.endswith(".safetensors") else None
        files.append([f.name, st.st_size, st.st_mtime_ns, header])
    return {"config_xxh3": src.config_xxh3, "index_xxh3": src.index_xxh3, "files": files,
            "tokenizer": dict(sorted(tokenizer_hashes.items()))}


def journal_header(inputs: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "header", "format": JOURNAL_FORMAT, "tool_version": __version__, "inputs": inputs,
            "options": options}


def header_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """A sentence naming what changed between two journal headers, or None when they match."""
    if old.get("format") != new["format"] or old.get("tool_version") != new["tool_version"]:
        return "it was written by another version of the converter"
    if old.get("options") != new["options"]:
        changed = sorted(k for k in new["options"] if (old.get("options") or {}).get(k) != new["options"][k])
        return f"the conversion options changed ({', '.join(changed) or 'options'})"
    old_in, new_in = old.get("inputs") or {}, new["inputs"]
    for key, what in (("config_xxh3", "config.json"), ("index_xxh3", "the safetensors index"),
                      ("tokenizer", "the tokenizer files")):
        if old_in.get(key) != new_in[key]:
            return f"{what} changed"
    if old_in.get("files") != new_in["files"]:
        old_files = {row[0]: row for row in old_in.get("files") or [] if isinstance(row, list) and row}
        changed = [row[0] for row in new_in["files"] if old_files.get(row[0]) != row]
        gone = sorted(set(old_files) - {row[0] for row in new_in["files"]})
        return f"weight files changed ({', '.join((changed + gone)[:4]) or 'file list'})"
    return None

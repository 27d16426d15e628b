"""Describe a `.colibri` file from its header and tables alone: time does not grow with the data."""

from __future__ import annotations

import os

from .. import spec as S
from ..reader import load_tables


def _hex(value: int) -> str:
    return f"{value:016x}"


def _header_dict(h: S.Header) -> dict:
    out = {}
    for f in S.HEADER_FIELDS:
        value = getattr(h, f.name)
        if f.name == "magic":
            value = value.rstrip(b"\0").decode("ascii", "replace")
        elif f.name == "reserved":
            value = "zero" if not any(value) else "NON-ZERO"
        elif f.name.endswith("checksum"):
            value = _hex(value)
        out[f.name] = value
    out["expert_format_name"] = S.EXPERT_FORMAT_NAMES[S.ExpertFormat(h.expert_format)]
    return out


def _metadata_summary(meta: dict) -> dict:
    quant = {k: v for k, v in meta["quantization"].items() if k != "error"}
    err = meta["quantization"].get("error")
    if isinstance(err, dict):
        quant["error"] = {k: v for k, v in err.items() if k != "per_expert"}
    tok = meta.get("tokenizer")
    tokenizer = None
    if isinstance(tok, dict):
        tokenizer = {"embedded": "tokenizer_json" in tok, "bytes": len(tok.get("tokenizer_json", "")),
                     "chat_template": isinstance(tok.get("tokenizer_config"), dict)
                     and "chat_template" in tok["tokenizer_config"]}
    return {"format": meta["format"], "spec_version": meta["spec_version"], "architecture": meta["architecture"],
            "model": meta["model"], "quantization": quant, "provenance": meta.get("provenance"),
            "tokenizer": tokenizer}


def inspect_file(path: str | os.PathLike) -> dict:
    """Header, metadata summary, dense tensors and the per-layer expert table of a file.

    Raises:
        ColibriFormatError: the header or a table is invalid.
    """
    t = load_tables(path)
    blob = t.plan.blob
    return {
        "path": str(path),
        "file_size": t.file_size,
        "header": _header_dict(t.header),
        "metadata": _metadata_summary(t.metadata),
        "dense_tensors": [{"name": e.name, "dtype": S.DType(e.dtype).name.lower(), "shape": list(e.shape),
                           "offset": e.offset, "size": e.size, "checksum": _hex(e.checksum)} for e in t.dense],
        "experts": {
            "blob_size": blob.size,
            "arrays": [{"name": a.name, "offset": a.offset, "shape": list(a.shape), "dtype": a.dtype.name.lower()}
                       for a in blob.arrays],
            "layers": list(t.plan.moe_layers),
            "entries": [{"layer": int(r["layer"]), "expert": int(r["expert"]), "offset": int(r["offset"]),
                         "size": int(r["size"]), "checksum": _hex(int(r["checksum"]))} for r in t.wsit],
        },
    }

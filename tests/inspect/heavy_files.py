"""Test helpers: valid `.colibri` files that are as heavy as the spec allows where a reader could be slow or
greedy: metadata near MAX_METADATA_BYTES (a big provenance as one string, many keys, long lists, deep nesting,
many small elements under MAX_JSON_ELEMENTS), many dense tensors, many experts (WSIT entries) of small size.

Every file is written with colibri_format.writer and passes `validate`. Expert blobs are one random blob reused
(fast); dense tensors are small.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from colibri_format import spec as S
from colibri_format.synthetic import synthetic_metadata, synthetic_model
from colibri_format.writer import ColibriWriter

MIB = 1 << 20


def write_file(path: str | os.PathLike, model: dict | None = None, *, provenance: Any = None,
               extra: dict | None = None, seed: int = 0) -> str:
    """A valid file of `model` (default: the small synthetic one) whose metadata `provenance` (and any `extra`
    top-level keys) the caller chooses."""
    model = model or synthetic_model()
    rng = np.random.default_rng(seed)
    with ColibriWriter(path, model, dense_dtype=S.DType.F32, expert_format=S.ExpertFormat.INT8_ROW) as w:
        for t in w.plan.dense:
            w.write_dense(t.name, (rng.standard_normal(t.shape) * 0.05).astype(np.float32))
        arrays = {a.name: (rng.integers(-127, 128, a.shape, dtype=np.int8) if a.dtype == S.DType.I8
                           else np.full(a.shape, 0.01, np.float32)) for a in w.plan.blob.arrays}
        blob = w.build_blob(arrays)
        for layer, e in w.plan.blob_keys():
            w.write_expert_blob(layer, e, blob)
        meta = synthetic_metadata(model, S.ExpertFormat.INT8_ROW, S.DType.F32)
        if provenance is not None:
            meta["provenance"] = provenance
        meta.update(extra or {})
        w.finalize(meta)
    return str(path)


# --- provenance shapes, each about `size` bytes of JSON and within MAX_JSON_ELEMENTS -----------------------------
ELEMENTS = S.MAX_JSON_ELEMENTS - 8192          # room for the rest of the metadata


def big_string(size: int) -> dict:
    """One string of about `size` bytes of JSON, with characters that need escaping and non-ASCII ones."""
    unit = 'note "quoted" \\ back\tslash é中 '
    encoded = len(json.dumps(unit, ensure_ascii=False).encode()) - 2
    return {"source_format": "synthetic", "notes": unit * (size // encoded)}


def many_keys(size: int) -> dict:
    """Just under MAX_JSON_ELEMENTS keys (or fewer, for a small `size`), values padded to fill `size`."""
    n = max(1, min(ELEMENTS, size // 16))
    pad = "v" * max(0, size // n - 16)
    return {f"k{i:07d}": pad + str(i) for i in range(n)}


def long_list(size: int) -> dict:
    """One list of just under MAX_JSON_ELEMENTS strings (or fewer), filling `size`."""
    n = max(1, min(ELEMENTS, size // 8))
    pad = "s" * max(0, size // n - 11)
    return {"files": [pad + str(i) for i in range(n)]}


def deep(size: int, depth: int = S.MAX_JSON_DEPTH - 2) -> dict:
    """Objects nested as deep as the spec allows (`depth` + 2 levels with the metadata object and the provenance
    key: MAX_JSON_DEPTH by default), each level a share of `size` as strings."""
    share = max(1, size // depth // 66)
    node: Any = ["x" * 64] * share
    for level in range(depth - 1):
        node = {"level": level, "items": node, "pad": ["y" * 64] * share}
    return {"tree": node}


def many_elements() -> dict:
    """Just under MAX_JSON_ELEMENTS elements of the cheapest kind to write and the dearest to parse per byte:
    empty objects, `[{},{},...]` (two elements each: the object and the comma)."""
    return {"empties": [{} for _ in range(ELEMENTS // 2)]}

"""Which dense tensors a backend loads: the file's tensors, with products that share an input fused.

A dense MLP's gate and up rows become one `{p}.gate_up` matrix, an attention's q, k and v rows (and biases) one
`{p}.qkv` / `{p}.qkv_bias`: one product each instead of two or three, on every backend alike, so the decoder
names only the fused tensors.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

FUSED_GROUPS = {".gate_proj": ((".gate_proj", ".up_proj"), ".gate_up"),
                ".q_proj": ((".q_proj", ".k_proj", ".v_proj"), ".qkv"),
                ".q_bias": ((".q_bias", ".k_bias", ".v_bias"), ".qkv_bias")}


def fused_dense_tensors(reader) -> Iterator[tuple[str, np.ndarray]]:
    """(name, host array in its stored dtype) for every tensor a backend keeps; verified by the reader on use."""
    names = set(reader.dense_names())
    members = set()
    for name in sorted(names):
        for head, (parts, fused) in FUSED_GROUPS.items():
            prefix = name[:-len(head)] if name.endswith(head) else None
            if prefix is not None and all(prefix + s in names for s in parts):
                members.update(prefix + s for s in parts)
                yield prefix + fused, np.concatenate([reader.dense(prefix + s) for s in parts])
    for name in sorted(names - members):
        yield name, reader.dense(name)

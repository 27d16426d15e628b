"""Small synthetic `.colibri` files with random weights: for tests, fuzzing, benchmarks and the demo.

Nothing here is a model anyone would run for its answers; it exercises every byte of the format.
"""

from __future__ import annotations

import os

import numpy as np

from . import spec as S
from .writer import ColibriWriter


def synthetic_model(*, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    experts: int = 4, top_k: int = 2, expert_inter: int = 48, dense_layers: tuple[int, ...] = (),
                    shared: int | None = None, qk_norm: str = "none", tie: bool = False) -> dict:
    """A normalized `model` object (docs/design.md) for a Mixtral-like toy model."""
    return {
        "vocab_size": vocab, "hidden_size": hidden, "num_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "rope": {"type": "default", "theta": 10000.0},
        "qkv_bias": False, "o_bias": False, "qk_norm": qk_norm, "clip_qkv": None, "sliding_window": None,
        "tie_word_embeddings": tie, "hidden_act": "silu",
        "moe_layers": [i for i in range(layers) if i not in dense_layers],
        "dense_intermediate_size": 64 if dense_layers else None,
        "num_experts": experts, "top_k": top_k, "expert_intermediate_size": expert_inter,
        "router": {"scoring": "softmax", "order": "softmax_topk", "normalize_topk": True, "bias": False, "scale": 1.0},
        "shared_expert": None if shared is None else {"intermediate_size": shared, "gate": "sigmoid"},
        "multipliers": {"embedding": 1.0, "residual": 1.0, "attention": None, "logits": 1.0},
    }


def synthetic_metadata(model: dict, expert_format: S.ExpertFormat, dense_dtype: S.DType,
                       group_size: int = 0) -> dict:
    dtype_name = {v: k for k, v in S.DTYPE_NAMES.items()}[S.DType(dense_dtype)]
    return {
        "format": "colibri", "spec_version": f"{S.VERSION_MAJOR}.{S.VERSION_MINOR}", "architecture": "synthetic",
        "model": model,
        "quantization": {"experts": S.EXPERT_FORMAT_NAMES[S.ExpertFormat(expert_format)], "bits": 8,
                         "group_size": group_size or None, "dense_dtype": dtype_name},
        "provenance": {"source_format": "synthetic", "tool": "colibri-format"},
        "tokenizer": None,
    }


def _expert_arrays(rng: np.random.Generator, blob: S.BlobLayout) -> dict[str, np.ndarray]:
    arrays = {}
    for a in blob.arrays:
        if a.dtype == S.DType.I8:
            arrays[a.name] = rng.integers(-127, 128, a.shape, dtype=np.int8)
        elif a.name.endswith("_scale"):
            arrays[a.name] = rng.uniform(0.001, 0.02, a.shape).astype(np.float32)
        else:
            arrays[a.name] = (rng.standard_normal(a.shape) * 0.05).astype(np.float32)
    return arrays


def write_synthetic(path: str | os.PathLike, model: dict | None = None, *, seed: int = 0,
                    expert_format: S.ExpertFormat = S.ExpertFormat.INT8_ROW, dense_dtype: S.DType = S.DType.F32,
                    group_size: int = 0, reuse_expert: bool = False) -> str:
    """Write a valid file with random weights. `reuse_expert` writes one random blob everywhere (fast, big files)."""
    model = model or synthetic_model()
    rng = np.random.default_rng(seed)
    w = ColibriWriter(path, model, dense_dtype=dense_dtype, expert_format=expert_format, group_size=group_size)
    try:
        for t in w.plan.dense:
            w.write_dense(t.name, (rng.standard_normal(t.shape) * 0.05).astype(np.float32))
        blob = w.build_blob(_expert_arrays(rng, w.plan.blob)) if reuse_expert else None
        for layer, e in w.plan.blob_keys():
            w.write_expert_blob(layer, e, blob if blob is not None else w.build_blob(_expert_arrays(rng, w.plan.blob)))
        w.finalize(synthetic_metadata(model, expert_format, dense_dtype, group_size))
    except BaseException:
        w.abort(remove_part=True)
        raise
    return str(path)

"""Synthetic inputs with random weights: for tests, fuzzing, benchmarks and the demo.

* `write_synthetic`: a small (or, with `reuse_expert=True`, big) `.colibri` file;
* `write_mixtral_checkpoint`: a Mixtral-layout safetensors checkpoint of any size (the converter's input),
  written at disk speed, without torch.

Nothing here is a model anyone would run for its answers; it exercises every byte of the format.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

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
        "format": "colibri", "spec_version": f"{S.VERSION_MAJOR}.{S.minor_version_for(expert_format)}",
        "architecture": "synthetic", "model": model,
        "quantization": {"experts": S.EXPERT_FORMAT_NAMES[S.ExpertFormat(expert_format)],
                         "bits": 4 if expert_format in S.PACKED_FORMATS else 8,   # 8 for every 1.0 format (corpus)
                         "group_size": group_size or None, "dense_dtype": dtype_name},
        "provenance": {"source_format": "synthetic", "tool": "colibri-format"},
        "tokenizer": None,
    }


def _expert_arrays(rng: np.random.Generator, blob: S.BlobLayout) -> dict[str, np.ndarray]:
    arrays = {}
    for a in blob.arrays:
        if a.dtype == S.DType.I8:
            arrays[a.name] = rng.integers(-127, 128, a.shape, dtype=np.int8)
        elif a.dtype in (S.DType.I4X2, S.DType.FP4X2):       # two random 4-bit codes a byte
            arrays[a.name] = rng.integers(0, 256, a.shape, dtype=np.uint8)
        elif a.dtype == S.DType.E8M0:                          # 2^-10 .. 2^-4, as trained weights' blocks have
            arrays[a.name] = rng.integers(117, 124, a.shape, dtype=np.uint8)
        elif a.name.endswith("_scale"):
            arrays[a.name] = rng.uniform(0.001, 0.02, a.shape).astype(np.float32)
        else:
            arrays[a.name] = (rng.standard_normal(a.shape) * 0.05).astype(np.float32)
    return arrays


def write_synthetic(path: str | os.PathLike, model: dict | None = None, *, seed: int = 0,
                    expert_format: S.ExpertFormat = S.ExpertFormat.INT8_ROW, dense_dtype: S.DType = S.DType.F32,
                    group_size: int = 0, reuse_expert: bool = False) -> str:
    """Write a valid file with random weights. `reuse_expert` writes one random blob everywhere (fast, big files).
    Raises WriteError (field free_space) before writing when the folder cannot hold the file."""
    model = model or synthetic_model()
    rng = np.random.default_rng(seed)
    w = ColibriWriter(path, model, dense_dtype=dense_dtype, expert_format=expert_format, group_size=group_size)
    try:
        w.check_free_space()
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


# --- Hugging Face checkpoints (the converter's input) ---------------------------------------------------------
# Legacy per-expert names (`block_sparse_moe.experts.{e}.w1/w2/w3`), bf16/f16/f32 storage, sharded by size with
# a `model.safetensors.index.json`. Values come from one random pool sliced at varying offsets, so multi-GB
# checkpoints are written at disk speed; they are meant to be converted, not run.

_SAFETENSORS_TAGS = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


def mixtral_checkpoint_config(*, vocab: int, hidden: int, layers: int, experts: int, inter: int, top_k: int = 2,
                              heads: int = 8, kv_heads: int = 2) -> dict:
    """A Mixtral `config.json` (as a dict) with these dimensions."""
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_local_experts": experts,
            "num_experts_per_tok": top_k, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False}


def mixtral_tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Mixtral checkpoint with config `cfg`, in writing order."""
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h)), ("model.norm.weight", (h,)),
           ("lm_head.weight", (cfg["vocab_size"], h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                (f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, h)),
                (f"{p}.block_sparse_moe.gate.weight", (cfg["num_local_experts"], h))]
        for e in range(cfg["num_local_experts"]):
            q = f"{p}.block_sparse_moe.experts.{e}"
            out += [(f"{q}.w1.weight", (i, h)), (f"{q}.w3.weight", (i, h)), (f"{q}.w2.weight", (h, i))]
    return out


class _ValuePool:
    """Random storage-dtype values; `take(n)` returns n of them from a moving offset (no big RNG cost)."""

    def __init__(self, dtype: str, seed: int, size: int = 1 << 24) -> None:
        rng = np.random.default_rng(seed)
        values = (rng.standard_normal(size, dtype=np.float32) * 0.02).astype(np.float32)
        if dtype == "bfloat16":
            self.data = (values.view(np.uint32) >> 16).astype(np.uint16)
        else:
            self.data = values.astype(np.float16 if dtype == "float16" else np.float32)
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        out = np.empty(n, self.data.dtype)
        done = 0
        while done < n:
            k = min(n - done, self.data.size - self.pos)
            out[done:done + k] = self.data[self.pos:self.pos + k]
            done += k
            self.pos = (self.pos + k + 7919) % (self.data.size - 1)
        return out


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], pool: _ValuePool, tag: str,
                 itemsize: int) -> int:
    header, pos = {}, 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in tensors:
            count = int(np.prod(shape))
            for start in range(0, count, 1 << 24):  # bounded memory for big tensors
                fh.write(pool.take(min(1 << 24, count - start)).tobytes())
    return 8 + len(raw) + pos


def write_mixtral_checkpoint(out_dir: str | os.PathLike, cfg: dict, *, dtype: str = "bfloat16",
                             shard_bytes: int = 2 << 30, seed: int = 0) -> int:
    """Write config.json, the safetensors shards and their index into `out_dir`; returns the bytes of tensor
    data. `cfg` is a `mixtral_checkpoint_config`; `dtype` the storage dtype (bfloat16, float16 or float32)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag, itemsize = _SAFETENSORS_TAGS[dtype]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in mixtral_tensor_shapes(cfg):
        n = int(np.prod(shape)) * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    pool = _ValuePool(dtype, seed)
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(out / fname, tensors, pool, tag, itemsize)
        for name, shape in tensors:
            weight_map[name] = fname
            total += int(np.prod(shape)) * itemsize
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": dtype}, indent=1))
    return total

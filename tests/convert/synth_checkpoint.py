"""Synthetic Mixtral-layout safetensors checkpoints of any size, without torch (crash tests, benchmarks).

Legacy per-expert names (`block_sparse_moe.experts.{e}.w1/w2/w3`), bf16/f16/f32 storage, sharded by size
with a `model.safetensors.index.json`. Values come from one random pool sliced at varying offsets, so
multi-GB checkpoints are written at disk speed; they are never run, only converted.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_TAGS = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


def mixtral_config(*, vocab: int, hidden: int, layers: int, experts: int, inter: int, top_k: int = 2,
                   heads: int = 8, kv_heads: int = 2) -> dict:
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_local_experts": experts,
            "num_experts_per_tok": top_k, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False}


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
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


class _Pool:
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


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], pool: _Pool, tag: str, itemsize: int) -> int:
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


def write_checkpoint(out_dir: str | Path, cfg: dict, *, dtype: str = "bfloat16", shard_bytes: int = 2 << 30,
                     seed: int = 0) -> int:
    """Write config.json, shards and the index; returns the total bytes of tensor data."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag, itemsize = _TAGS[dtype]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(cfg):
        n = int(np.prod(shape)) * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    pool = _Pool(dtype, seed)
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

"""Pre-quantized checkpoints crafted from tiny saved ones, in the real on-disk layouts, for tests.

`to_fp8(folder, block)`: every linear weight of attention and the experts (not the router, norms, embeddings or
head: the `modules_to_not_convert` of the published FP8 releases) becomes an FP8 e4m3 tensor with a float32
`weight_scale_inv` per block (DeepSeek-V3 / GLM-4.5-FP8 / MiniMax-M2); `to_mxfp4(folder)`: gpt-oss's expert
matrices become `*_blocks` / `*_scales` (the openai/gpt-oss release). Each also writes a `dequantized` copy of
the checkpoint (the float values the quantized one stands for), from which transformers builds the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0


def fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [R, C], scale_inv [ceil(R/bm), ceil(C/bn)] f32, dequantized f32) with scale = block absmax / 448."""
    bm, bn = block
    r, c = w.shape
    pr, pc = -(-r // bm) * bm, -(-c // bn) * bn
    padded = torch.zeros(pr, pc)
    padded[:r, :c] = w.float()
    blocks = padded.reshape(pr // bm, bm, pc // bn, bn)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX                  # [R/bm, C/bn]
    full = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:r, :c]
    q = (w.float() / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _fp8_target(name: str, t: torch.Tensor) -> bool:
    return (t.ndim == 2 and name.endswith(".weight") and ("self_attn." in name or ".experts." in name
                                                          or "shared_expert" in name or ".mlp." in name)
            and "norm" not in name and not name.endswith(".gate.weight"))


def _rewrite(folder: Path, dest: Path, tensors: dict[str, torch.Tensor], quant: dict | None) -> Path:
    if dest != folder:
        shutil.copytree(folder, dest)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant is not None:
        config["quantization_config"] = quant
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def to_fp8(folder: Path, out: Path, block: tuple[int, int]) -> tuple[Path, Path]:
    """(FP8 checkpoint, its dequantized float32 twin), both under `out`."""
    tensors = load_file(str(folder / "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if _fp8_target(name, t):
            q, scale, d = fp8_blocks(t, block)
            fp8[name], fp8[name + "_scale_inv"], deq[name] = q, scale, d
        else:
            fp8[name] = deq[name] = t
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return _rewrite(folder, out / "fp8", fp8, quant), _rewrite(folder, out / "dequantized", deq, None)


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., R, C] (C a multiple of 32) -> (blocks uint8 [..., R, C/32, 16], scales uint8 [..., R, C/32],
    dequantized [..., R, C]): per 32 values the power-of-two scale that puts the block's absmax within 6, each
    value rounded to the nearest FP4 value."""
    *lead, r, c = w.shape
    g = w.float().reshape(*lead, r, c // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)                         # 2^exp * 6 >= amax
    scaled = g / torch.exp2(exp)[..., None]
    idx = (scaled[..., None] - FP4).abs().argmin(-1)                                   # nearest of the 16 codes
    deq = FP4[idx] * torch.exp2(exp)[..., None]
    nib = idx.to(torch.uint8)
    blocks = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8), deq.reshape(*lead, r, c)


def to_mxfp4(folder: Path, out: Path) -> tuple[Path, Path]:
    """gpt-oss: (MXFP4 checkpoint, its dequantized twin). The bf16/fp32 save keeps the experts in-features first
    (gate_up [E, H, 2I], down [E, I, H]); the MXFP4 release stores their blocks out-features first."""
    tensors = load_file(str(folder / "model.safetensors"))
    mx, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, d = mxfp4_blocks(t.transpose(1, 2).contiguous())            # [E, out, in]
            mx[name + "_blocks"], mx[name + "_scales"] = blocks, scales
            deq[name] = d.transpose(1, 2).contiguous()
        else:
            mx[name] = deq[name] = t
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]}
    return _rewrite(folder, out / "mxfp4", mx, quant), _rewrite(folder, out / "dequantized", deq, None)


def load_reference(folder: Path):
    """transformers' fp32 eager model from a (dequantized) checkpoint folder."""
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                   experts_implementation="eager").eval()


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


# --- compressed-tensors "pack-quantized" (Kimi-K2-Thinking / K2.5) -------------------------------------------------
# As the compressed-tensors package writes it (pack_quantized.py's pack_to_int32, read in its source; the package is
# not installed): symmetric int4 q = clamp(round(w / s), -8, 7) with s = group absmax / 7.5 (its minmax observer:
# max|w| over half the 15-step range), stored as offset-8 fields, eight a little-endian int32 word, the first column in
# the lowest bits; `weight_scale` in bf16, `weight_shape` int64.
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int q [R, C] in [-8, 7] -> int32 [R, ceil(C / 8)], pack_to_int32's layout (zero fields pad the last word)."""
    r, c = q.shape
    fields = torch.zeros(r, -(-c // 8) * 8, dtype=torch.int64)
    fields[:, :c] = q.to(torch.int64) + 8
    words = (fields.reshape(r, -1, 8) << (4 * torch.arange(8))).sum(-1)          # < 2^32
    return (words - ((words >> 31) << 32)).to(torch.int32)                          # as a signed int32


def int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, C] -> (q int8 [R, C], bf16 scales [R, ceil(C / group)], dequantized f32 q * scale)."""
    r, c = w.shape
    ng = -(-c // group)
    padded = torch.zeros(r, ng * group)
    padded[:, :c] = w.float()
    scale = (padded.reshape(r, ng, group).abs().amax(-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
    full = scale.float().repeat_interleave(group, 1)[:, :c]
    q = torch.clamp(torch.round(w.float() / full), -8, 7).to(torch.int8)
    return q, scale, q.float() * full


def packed_quant_config(group: int | None = 32, ignore: list[str] | None = None, **weights) -> dict:
    """Kimi-K2-Thinking's quantization_config (group None: the "channel" strategy), `weights` changed."""
    args = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group, "num_bits": 4,
            "observer": "minmax", "observer_kwargs": {}, "strategy": "group" if group else "channel",
            "symmetric": True, "type": "int", **weights}
    return {"config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": args}},
            "format": "pack-quantized", "ignore": KIMI_IGNORE if ignore is None else ignore,
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def to_pack_quantized(folder: Path, out: Path, group: int | None = 32, model_type: str | None = None
                      ) -> tuple[Path, Path]:
    """(pack-quantized checkpoint of the routed experts, its dequantized float32 twin), under `out`; `model_type`
    replaces config.json's (Kimi ships "kimi_k2")."""
    tensors = load_file(str(folder / "model.safetensors"))
    packed, deq = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            q, scale, d = int4_groups(t, group or t.shape[1])
            base = name[:-len(".weight")]
            packed[base + ".weight_packed"], packed[base + ".weight_scale"] = pack_int4(q), scale
            packed[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            deq[name] = d
        else:
            packed[name] = deq[name] = t
    dirs = _rewrite(folder, out / "packed", packed, packed_quant_config(group)), _rewrite(folder, out / "dequantized",
                                                                                         deq, None)
    if model_type is not None:
        for d in dirs:
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return dirs

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

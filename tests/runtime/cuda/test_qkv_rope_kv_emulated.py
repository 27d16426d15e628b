"""fused.cu's qkv_rope_kv on the CPU (cuda_host_emulation.py) against the float64 NumPy twin: the full q/k norm
(OLMoE; rows held in registers when aligned and small enough, the strided loop otherwise), the per-head norm
(Qwen3), none (Mixtral), clips, partial and no rotary, several rows, f32 and bf16 norm weights. The GPU test is
test_gpu_fused_kernels.py's test_qkv_rope_kv."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.dtypes import float32_to_bf16_bits
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from tests.runtime.cuda.cuda_host_emulation import GXX
from tests.runtime.cuda.test_norms_emulated import at_offset

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 2e-6                                      # fp32 math against float64, relative to the largest value
REGISTER_MAX = 4 * limits.NORM_VECS * limits.QKV_THREADS   # the widest q or k part a thread's registers hold
CASES = [  # N, heads, kv_heads, hd, rot, norm, clip, qkv offset (elements; 1: not 16-byte aligned)
    (1, 16, 16, 128, 128, "full", None, 0),         # OLMoE: 2048 + 2048 values, held in registers
    (1, 16, 16, 128, 128, "full", None, 1),         # the same off a 16-byte boundary: the strided loop
    (3, 4, 4, 256, 256, "full", 1.5, 0),            # clip after the full norm, several rows
    (2, REGISTER_MAX // 64 + 1, 2, 64, 64, "full", None, 0),   # q wider than the registers hold: the strided loop
    (1, 6, 2, 36, 36, "full", None, 0),             # q 216, k 72 values: rows not a multiple of a block's float4s
    (1, 32, 4, 128, 128, "per_head", None, 0),      # Qwen3
    (5, 6, 2, 64, 64, "per_head", 0.7, 0),          # clip before the per-head norm
    (4, 8, 2, 64, 32, "per_head", None, 0),         # partial rotary
    (1, 32, 8, 128, 128, "none", None, 0),          # Mixtral
    (2, 4, 1, 128, 0, "none", None, 0),             # no rotary
]


def rel(got, exp) -> float:
    return float(np.abs(np.asarray(got, np.float64) - exp).max() / max(np.abs(exp).max(), 1e-30))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("wdt", ["f32", "bf16"])
def test_qkv_rope_kv_matches_float64(norm_emulator, case, wdt):
    N, nh, nkv, hd, rot, norm, clip, offset = case
    rng = np.random.default_rng(N * 1000 + nh + hd + offset)
    S, cap, npos = 3, max(16, N + 2), max(N, 8)
    qkv = at_offset((rng.standard_normal((N, (nh + 2 * nkv) * hd)) * 2).astype(np.float32), offset)
    kc = rng.standard_normal((S, cap, nkv, hd)).astype(np.float32)
    vc = rng.standard_normal((S, cap, nkv, hd)).astype(np.float32)
    seq = rng.integers(0, S, N).astype(np.int32)
    pos = rng.permutation(cap)[:N].astype(np.int32)
    rpos = rng.integers(0, npos, N).astype(np.int32)
    half = rot // 2
    ang = np.arange(npos)[:, None] * (1e4 ** (-np.arange(half) / max(half, 1)))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    sizes = (nh * hd, nkv * hd) if norm == "full" else (hd, hd)
    wq32, wk32 = (rng.uniform(0.5, 1.5, n).astype(np.float32) for n in sizes)
    if wdt == "bf16":
        wq, wk = float32_to_bf16_bits(wq32), float32_to_bf16_bits(wk32)
        wq32, wk32 = nb.widen(wq, np.float32), nb.widen(wk, np.float32)
    else:
        wq, wk = wq32, wk32
    exp_k, exp_v = kc.astype(np.float64), vc.astype(np.float64)
    exp_q = nb.qkv_rope_kv(qkv.astype(np.float64), nh, nkv, exp_k, exp_v, seq, pos, rpos, cos, sin, norm=norm,
                           eps=1e-6, clip=clip, q_norm=wq32.astype(np.float64), k_norm=wk32.astype(np.float64))
    q_out = np.full((N, nh, hd), np.nan, np.float32)
    norm_emulator.qkv_rope_kv(qkv, nh, nkv, kc, vc, seq, pos, rpos, cos, sin, q_out, norm=norm, wq=wq, wk=wk, eps=1e-6,
                         clip=clip)
    assert norm_emulator.errors() == (0, "")
    assert rel(q_out, exp_q) < TOL
    assert rel(kc[seq, pos], exp_k[seq, pos]) < TOL       # the rows written (the rest is untouched input)
    assert rel(vc[seq, pos], exp_v[seq, pos]) < TOL
    assert rel(kc, exp_k) < TOL and rel(vc, exp_v) < TOL

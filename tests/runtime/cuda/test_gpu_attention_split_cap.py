"""The wider split cap benchmarks/attention_decode.py times with --define ATT_MAX_SPLITS=N, on the GPU: layers.cu
rebuilt (this process only, restored after) with 4x limits.py's cap, against the NumPy float64 attention. The CPU
twins are in test_attention_decode_emulated.py; the kernels that run by default are tested in test_gpu_kernels.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.dtypes import float32_to_bf16_bits
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops

TOL = 2e-5
WIDE_CAP = {"ATT_MAX_SPLITS": 4 * limits.ATT_MAX_SPLITS}


@pytest.fixture(scope="module")
def wide_cap():
    """layers.cu built with WIDE_CAP (and limits' ATT_MAX_SPLITS, which ops checks nsplit against); restored
    after the module's tests, so later tests build limits.py's kernels again."""
    defines = limits.KERNEL_DEFINES["layers"]
    saved, saved_cap = {name: defines[name] for name in WIDE_CAP}, limits.ATT_MAX_SPLITS
    defines.update(WIDE_CAP)
    limits.ATT_MAX_SPLITS = WIDE_CAP["ATT_MAX_SPLITS"]
    ops.forget_module("layers")
    try:
        yield WIDE_CAP
    finally:
        defines.update(saved)
        limits.ATT_MAX_SPLITS = saved_cap
        ops.forget_module("layers")


def rel(out, expected) -> float:
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    assert out.shape == expected.shape and np.isfinite(out).all(), "unwritten or non-finite output"
    return float(np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-30))


@pytest.mark.parametrize("cache", ["f32", "bf16"])
@pytest.mark.parametrize("window", [0, 40])
def test_wide_splits_match_float64(cp, rng, wide_cap, cache, window):
    """Rows of 1 to 4096 keys on one workspace planned for the widest split count (as a captured graph replays it),
    split up to the wider cap; sinks; the tickets end at zero after every launch."""
    S, cap, nkv, nh, hd = 2, 4096, 4, 32, 128
    ns = wide_cap["ATT_MAX_SPLITS"]
    k_h, v_h = (rng.standard_normal((S, cap, nkv, hd)).astype(np.float32) for _ in range(2))
    if cache == "bf16":
        k_h, v_h = float32_to_bf16_bits(k_h), float32_to_bf16_bits(v_h)
    kc, vc = cp.asarray(k_h), cp.asarray(v_h)
    k64, v64 = nb.widen(k_h, np.float64), nb.widen(v_h, np.float64)
    sinks = rng.standard_normal(nh).astype(np.float32)
    ws = ops.AttentionWorkspace(2, nh, hd, ns)
    for lens in ([1, 90], [127, 128], [129, 300], [4096, 2], [4095, 128]):
        q_seq, q_len = np.array([0, 1], np.int32), np.array(lens, np.int32)
        q = rng.standard_normal((2, nh, hd)).astype(np.float32)
        exp = nb.attention(q.astype(np.float64), k64, v64, q_seq, q_len, 0.1, window=window,
                           sinks=sinks.astype(np.float64))
        out = ops.attention(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), 0.1, window=window,
                            sinks=cp.asarray(sinks), out=cp.full(q.shape, np.nan, cp.float32), nsplit=ns,
                            workspace=ws)
        assert rel(out.get(), exp) < TOL, lens
        assert int(ws.tickets.sum()) == 0, lens

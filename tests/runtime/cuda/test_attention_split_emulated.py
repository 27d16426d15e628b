"""layers.cu's attention_split and attention_merge on the CPU (cuda_host_emulation.py: built with g++, a thread per
CUDA thread, warp shuffles emulated, blocks in shuffled orders) against `numpy_backend.attention` in float64: the
prefill path `ops.attention` takes beyond ATT_DECODE_MAX_ROWS rows with flash_prefill off (a lane per key, the
block's warps merged in shared memory, splits merged by attention_merge). Causal rows of one and of two sequences,
unsplit and split (empty splits included), windows, sinks, GQA groups of one and of two head chunks, 16-bit
caches, head sizes 64 to 256. The GPU tests are test_gpu_kernels.py's test_attention and test_attention_long_context.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from tests.runtime.cuda.cuda_host_emulation import GXX, AttentionEmulator, build_layers
from tests.runtime.cuda.test_attention_decode_emulated import caches

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 1e-5          # fp32 math against float64
ROWS = limits.ATT_DECODE_MAX_ROWS + 8     # past the decode kernel's rows: the split path


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return AttentionEmulator(build_layers(tmp_path_factory.mktemp("layers_split")))


def prefill_rows(lengths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(q_seq, q_len) of causal prefill rows: sequence i's prompt of lengths[i] tokens, row j attending to j + 1
    keys."""
    seq = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(lengths)])
    qlen = np.concatenate([np.arange(1, n + 1, dtype=np.int32) for n in lengths])
    return seq, qlen


def check(emulator, rng, *, lengths=(ROWS,), nh: int = 8, nkv: int = 2, hd: int = 64, cache: str = "f32",
          nsplit: int = 1, window: int = 0, with_sinks: bool = False, order: int = 1) -> None:
    k, v = caches(rng, nkv, hd, cache, capacity=max(lengths))
    q_seq, q_len = prefill_rows(lengths)
    q_seq = ((q_seq + 1) % 2).astype(np.int32)           # the first prompt reads sequence 1, the second sequence 0
    q = rng.standard_normal((len(q_seq), nh, hd)).astype(np.float32)
    sinks = rng.standard_normal(nh).astype(np.float32) * 3 if with_sinks else None
    scale = 1 / math.sqrt(hd)
    out = emulator.attention(q, k, v, q_seq, q_len, scale, window=window, sinks=sinks, nsplit=nsplit, order=order)
    assert emulator.errors() == (0, "")
    exp = nb.attention(q.astype(np.float64), nb.widen(k, np.float64), nb.widen(v, np.float64), q_seq, q_len, scale,
                       window=window, sinks=sinks)
    assert np.isfinite(out).all(), "non-finite output (an unwritten element, or a merge of unwritten partials)"
    err = np.abs(out - exp).max() / np.abs(exp).max()
    assert err < TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("nsplit", [1, 3, 16])
def test_causal_rows_unsplit_and_split(emulator, nsplit):
    """Rows 1..40 of one prompt: 16 splits leave the first rows' later splits empty (merged as weight 0)."""
    check(emulator, np.random.default_rng(nsplit), nsplit=nsplit, order=nsplit)


@pytest.mark.parametrize("window", [5, 33])
def test_windows(emulator, window):
    check(emulator, np.random.default_rng(window), nsplit=3, window=window)


@pytest.mark.parametrize("nsplit", [1, 4])
def test_sinks(emulator, nsplit):
    check(emulator, np.random.default_rng(10 + nsplit), nsplit=nsplit, with_sinks=True)


def test_two_prompts_in_one_pass(emulator):
    check(emulator, np.random.default_rng(3), lengths=(21, 19), nsplit=2, with_sinks=True)


@pytest.mark.parametrize("heads", [(4, 4), (16, 1)])
def test_gqa_groups(emulator, heads):
    """One head a kv head, and 16 (two chunks of ATT_GMAX heads)."""
    nh, nkv = heads
    check(emulator, np.random.default_rng(nh), nh=nh, nkv=nkv, nsplit=2)


@pytest.mark.parametrize("hd,cache", [(128, "bf16"), (256, "f16"), (64, "bf16")])
def test_head_sizes_and_16_bit_caches(emulator, hd, cache):
    check(emulator, np.random.default_rng(hd), nh=4, nkv=2, hd=hd, cache=cache, nsplit=3)

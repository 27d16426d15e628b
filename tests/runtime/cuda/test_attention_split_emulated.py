"""layers.cu's attention_split and attention_merge on the CPU (cuda_host_emulation.py: built with g++, a thread per
CUDA thread, warp shuffles emulated, blocks in shuffled orders) against `numpy_backend.attention` in float64: the
prefill path `ops.attention` takes beyond ATT_DECODE_MAX_ROWS rows with flash_prefill off (a lane per key, the
block's warps merged in shared memory, splits merged by attention_merge). Rows of 1 to 40 keys over two cache
sequences (as a prompt's rows are), unsplit and split (empty splits included), windows, sinks, GQA groups of one and
of two head chunks, 16-bit caches, head sizes 64 to 256; `check` is the decode tests' (a workspace of NaN partials,
so a merge of an unwritten one shows). The GPU tests are test_gpu_kernels.py's test_attention and
test_attention_long_context.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime.cuda import limits
from tests.runtime.cuda.cuda_host_emulation import GXX, AttentionEmulator, build_layers
from tests.runtime.cuda.test_attention_decode_emulated import check

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

ROWS = tuple(range(1, limits.ATT_DECODE_MAX_ROWS + 9))     # past the decode kernel's rows: the split path


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return AttentionEmulator(build_layers(tmp_path_factory.mktemp("layers_split")))


@pytest.mark.parametrize("nsplit", [1, 3, 16])
def test_rows_unsplit_and_split(emulator, nsplit):
    """16 splits leave the short rows' later splits empty (merged as weight 0)."""
    check(emulator, np.random.default_rng(nsplit), nh=8, nkv=2, hd=64, lengths=ROWS, nsplit=nsplit, order=nsplit)


@pytest.mark.parametrize("window", [5, 33])
def test_windows(emulator, window):
    check(emulator, np.random.default_rng(window), nh=8, nkv=2, hd=64, lengths=ROWS, nsplit=3, window=window)


@pytest.mark.parametrize("nsplit", [1, 4])
def test_sinks(emulator, nsplit):
    check(emulator, np.random.default_rng(10 + nsplit), nh=8, nkv=2, hd=64, lengths=ROWS, nsplit=nsplit,
          with_sinks=True)


def test_two_prompts_in_one_pass(emulator):
    lengths = tuple(range(1, 22)) + tuple(range(1, 20))
    check(emulator, np.random.default_rng(3), nh=8, nkv=2, hd=64, lengths=lengths, nsplit=2, with_sinks=True)


@pytest.mark.parametrize("heads", [(4, 4), (16, 1)])
def test_gqa_groups(emulator, heads):
    """One head a kv head, and 16 (two chunks of ATT_GMAX heads)."""
    nh, nkv = heads
    check(emulator, np.random.default_rng(nh), nh=nh, nkv=nkv, hd=64, lengths=ROWS, nsplit=2)


@pytest.mark.parametrize("hd,cache", [(128, "bf16"), (256, "f16"), (64, "bf16")])
def test_head_sizes_and_16_bit_caches(emulator, hd, cache):
    check(emulator, np.random.default_rng(hd), nh=4, nkv=2, hd=hd, cache=cache, lengths=ROWS, nsplit=3)

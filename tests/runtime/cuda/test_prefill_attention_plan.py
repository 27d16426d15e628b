"""The host plan of the flash prefill attention kernel (`ops.prefill_attention_plan`, CPU only): every (row, query
head) pair of a pass lands in exactly one tile, no tile straddles two sequences, and each tile's key range covers
every key its pairs attend to. Also the kernel's shared memory fits a Hopper block."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops

HOPPER_SHARED_MEMORY_OPT_IN = 227 * 1024     # the most dynamic shared memory an sm_90 block may opt in to


def packed_rows(lengths_and_starts, order):
    """q_seq, q_len of a pass packing, in `order`, sequence s's rows at positions start_s .. start_s + n_s - 1."""
    seq, lens = [], []
    for s in order:
        n, start = lengths_and_starts[s]
        seq += [s] * n
        lens += list(range(start + 1, start + n + 1))
    return np.array(seq, np.int32), np.array(lens, np.int32)


def check_plan(plan, seq, lens, group, window):
    assert plan.dtype == np.int32 and plan.shape[1] == limits.FA_PLAN_FIELDS
    covered = np.zeros((seq.size, group), np.int64)
    for row0, pair0, npairs, kbegin, kend in plan:
        assert 1 <= npairs <= limits.FA_BM
        pairs = pair0 + np.arange(npairs)
        rows, heads = row0 + pairs // group, pairs % group
        assert (seq[rows] == seq[row0]).all(), "a tile straddles two sequences"
        assert row0 == 0 or seq[row0 - 1] != seq[row0], "pairs are numbered from their span's first row"
        np.add.at(covered, (rows, heads), 1)
        lo = np.maximum(lens[rows] - window, 0) if window > 0 else np.zeros(rows.size)
        assert kbegin == lo.min() and kend == lens[rows].max()
    assert (covered == 1).all(), "every pair in exactly one tile"
    keys = plan[:, 4] - plan[:, 3]
    assert (keys[:-1] >= keys[1:]).all(), "longest key range first"


@pytest.mark.parametrize("group", [1, 3, 4, 8, 64, 100])
@pytest.mark.parametrize("window", [0, 100])
def test_plan_covers_every_pair_once_within_one_sequence(group, window):
    spans = {0: (1, 0), 1: (17, 0), 2: (64, 0), 3: (65, 5), 4: (300, 700), 5: (1000, 0)}
    seq, lens = packed_rows(spans, [3, 0, 5, 1, 4, 2])
    check_plan(ops.prefill_attention_plan(seq, lens, group, window), seq, lens, group, window)


def test_plan_splits_a_sequence_that_comes_back_after_another():
    seq = np.array([0, 0, 1, 1, 0, 0], np.int32)
    lens = np.array([1, 2, 1, 2, 3, 4], np.int32)
    plan = ops.prefill_attention_plan(seq, lens, 2)
    assert plan[:, 0].tolist() == [4, 0, 2]         # its second span has the most keys
    check_plan(plan, seq, lens, 2, 0)


def test_empty_pass_has_no_tiles():
    assert ops.prefill_attention_plan(np.zeros(0, np.int32), np.zeros(0, np.int32), 4).shape == (0, 5)


@pytest.mark.parametrize("head_dim", limits.FA_HEAD_DIMS)
@pytest.mark.parametrize("cache", ["f32", "bf16"])
def test_shared_memory_fits_a_hopper_block(head_dim, cache):
    assert limits.prefill_attention_shared_bytes(head_dim, cache) <= HOPPER_SHARED_MEMORY_OPT_IN


def test_the_opt_in_kernel_is_compiled_on_first_use_only():
    """ops.warm_up skips EAGER_MODULES: an engine without flash_prefill never compiles attention_prefill.cu."""
    assert ops.EAGER_MODULES == ("attention_prefill", "moe_gemm_cublas") and set(ops.EAGER_MODULES) <= set(ops.MODULES)

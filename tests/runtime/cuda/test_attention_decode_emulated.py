"""layers.cu's attention_decode on the CPU (cuda_host_emulation.py: built with g++, a thread per CUDA thread, warp
shuffles emulated, blocks in shuffled orders) against `numpy_backend.attention` in float64: key batches and their
masked tail, splits (1, a few, ATT_MAX_SPLITS) over short and long contexts, the minimum keys a split takes, windows,
sinks, GQA groups of one, a partial chunk, one chunk and two chunks of ATT_GMAX heads, 16-bit caches, and the last
block's merge over repeated launches on one workspace (its tickets back at zero after each), one used split writing an
unsplit launch's bits, a build with a wider split cap, the merge's batched loads against a build that adds one split
at a time (the same bits), and the key tiles' copy pipeline against a four-stage build (the same bits). The GPU tests
are in test_gpu_kernels.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from colibri_format.dtypes import float32_to_bf16_bits
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from tests.runtime.cuda.cuda_host_emulation import GXX, AttentionEmulator, build_layers

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 1e-5          # fp32 math against float64
CAPACITY = 320      # keys a cache sequence holds (the emulation runs a thread per CUDA thread: small sizes)
LENGTHS = (1, 15, 16, 17, 100, 300)
SPLITS = (1, 3, limits.ATT_MAX_SPLITS)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return AttentionEmulator(build_layers(tmp_path_factory.mktemp("layers_host")))


def caches(rng, nkv: int, hd: int, cache: str, capacity: int = CAPACITY) -> tuple[np.ndarray, np.ndarray]:
    """K and V [2, capacity, nkv, hd] of `cache` storage (bf16 as uint16 bits)."""
    k, v = (rng.standard_normal((2, capacity, nkv, hd)).astype(np.float32) for _ in range(2))
    if cache == "bf16":
        return float32_to_bf16_bits(k), float32_to_bf16_bits(v)
    return (k, v) if cache == "f32" else (k.astype(np.float16), v.astype(np.float16))


def check(emulator, rng, *, nh: int = 8, nkv: int = 1, hd: int = 128, cache: str = "f32", lengths=(100,),
          nsplit: int = 3, window: int = 0, with_sinks: bool = False, workspace=None, order: int = 1,
          capacity: int = CAPACITY) -> None:
    """Rows of `lengths` (row n reads cache sequence (n + 1) % 2) against the float64 reference; the workspace's
    tickets are back at zero."""
    k, v = caches(rng, nkv, hd, cache, capacity)
    q = rng.standard_normal((len(lengths), nh, hd)).astype(np.float32)
    q_seq = ((np.arange(len(lengths)) + 1) % 2).astype(np.int32)
    q_len = np.asarray(lengths, np.int32)
    sinks = rng.standard_normal(nh).astype(np.float32) * 3 if with_sinks else None
    scale = 1 / math.sqrt(hd)
    ws = workspace or AttentionEmulator.workspace(len(lengths), nh, hd, nsplit)
    out = emulator.attention(q, k, v, q_seq, q_len, scale, window=window, sinks=sinks, nsplit=nsplit,
                             workspace=ws, order=order)
    assert emulator.errors() == (0, "")
    assert not ws["tickets"].any(), f"tickets left at {ws['tickets']}"
    exp = nb.attention(q.astype(np.float64), nb.widen(k, np.float64), nb.widen(v, np.float64), q_seq, q_len, scale,
                       window=window, sinks=sinks)
    assert np.isfinite(out).all(), "non-finite output (unwritten element, or a merge of unwritten partials)"
    err = np.abs(out - exp).max() / np.abs(exp).max()
    assert err < TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("nsplit", SPLITS)
@pytest.mark.parametrize("length", LENGTHS)
def test_lengths_and_splits(emulator, length, nsplit):
    """Batch tails (15, 16, 17 keys), splits past the span (length 1 over 64 splits), a second row of another length
    and sequence."""
    check(emulator, np.random.default_rng(length * 100 + nsplit), lengths=(length, length // 3 + 2), nsplit=nsplit)


@pytest.mark.parametrize("nsplit", SPLITS[1:])
@pytest.mark.parametrize("length", (17, 100, 300))
def test_window(emulator, length, nsplit):
    check(emulator, np.random.default_rng(length + nsplit), lengths=(length, 5), nsplit=nsplit, window=37)


@pytest.mark.parametrize("nsplit", SPLITS)
@pytest.mark.parametrize("length", (1, 17, 100))
def test_sinks(emulator, length, nsplit):
    check(emulator, np.random.default_rng(length + 7 * nsplit), lengths=(length,), nsplit=nsplit, with_sinks=True)


@pytest.mark.parametrize("nsplit", SPLITS)
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (8, 1), (16, 1)], ids=lambda h: f"g{h[0] // h[1]}")
def test_gqa_groups(emulator, heads, nsplit):
    """A head per kv head (one warp of four has a head), a partial chunk, one chunk of ATT_GMAX heads, two chunks."""
    nh, nkv = heads
    check(emulator, np.random.default_rng(nh + nsplit), nh=nh, nkv=nkv, lengths=(40, 3), nsplit=nsplit,
          with_sinks=True)


@pytest.mark.parametrize("cache", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_head_dims_and_caches(emulator, hd, cache):
    """Batches of 16, 8 and 4 keys (ATT_LANE_FLOATS / values a lane holds) from each cache type."""
    check(emulator, np.random.default_rng(hd), hd=hd, cache=cache, lengths=(33, 18), nsplit=3, with_sinks=True)


def test_repeated_launches_on_one_workspace(emulator):
    """As graph replays do: one workspace, lengths that shrink and grow (a merge that read a split past this launch's
    used ones would read the last launch's partials), each launch's blocks in another order; the tickets are back at
    zero after every launch (check)."""
    rng = np.random.default_rng(5)
    ns = limits.ATT_MAX_SPLITS
    ws = AttentionEmulator.workspace(2, 16, 128, ns)
    for i, length in enumerate((200, 40, 1, 17, 64)):
        check(emulator, rng, nh=16, lengths=(length, length % 37 + 1), nsplit=ns, workspace=ws, order=i + 1,
              with_sinks=i % 2 == 1)


@pytest.mark.parametrize("lengths,window", [((16, 1), 0), ((5, 0), 0), ((300, 200), 9)])
@pytest.mark.parametrize("nsplit", [3, limits.ATT_MAX_SPLITS])
def test_one_used_split_writes_the_bits_of_an_unsplit_launch(emulator, lengths, window, nsplit):
    """Spans of at most ATT_DECODE_MIN_KEYS keys (and empty ones) fill one split: its block writes the output itself
    (no partials, ticket or merge), so a grid planned for many splits gives an unsplit launch's bits, sinks
    included, and the tickets stay at zero."""
    rng = np.random.default_rng(sum(lengths) + nsplit)
    k, v = caches(rng, 2, 128, "f32")
    q = rng.standard_normal((len(lengths), 16, 128)).astype(np.float32)
    q_seq = ((np.arange(len(lengths)) + 1) % 2).astype(np.int32)
    sinks = rng.standard_normal(16).astype(np.float32)
    outs = []
    for ns in (nsplit, 1):
        ws = AttentionEmulator.workspace(len(lengths), 16, 128, ns)
        outs.append(emulator.attention(q, k, v, q_seq, np.asarray(lengths, np.int32), 1 / math.sqrt(128),
                                       window=window, sinks=sinks, nsplit=ns, workspace=ws, order=2))
        assert emulator.errors() == (0, "")
        assert not ws["tickets"].any()
    assert np.isfinite(outs[0]).all()
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


WIDE_SPLITS = 4 * limits.ATT_MAX_SPLITS    # a candidate cap benchmarks/attention_decode.py times with --define


@pytest.fixture(scope="module")
def wide_emulator(tmp_path_factory):
    return AttentionEmulator(build_layers(tmp_path_factory.mktemp("layers_wide"), ATT_MAX_SPLITS=WIDE_SPLITS),
                                   max_splits=WIDE_SPLITS)


@pytest.mark.parametrize("nsplit", [limits.ATT_MAX_SPLITS + 32, WIDE_SPLITS])
def test_a_wider_split_cap_merges_alike(wide_emulator, nsplit):
    """Built with ATT_MAX_SPLITS raised (the merge's lanes take more rounds of splits, its weights more shared
    memory): every split used (each its minimum keys) and a short row that uses two, with sinks."""
    length = limits.ATT_DECODE_MIN_KEYS * nsplit
    check(wide_emulator, np.random.default_rng(nsplit), nh=8, nkv=1, hd=64, lengths=(length, 20), nsplit=nsplit,
          with_sinks=True, capacity=length)


@pytest.fixture(scope="module")
def one_split_at_a_time(tmp_path_factory):
    """layers.cu with ATT_MERGE_LOADS = 1: the last block's merge adds one split's partials at a time (the order
    before its loads were batched)."""
    return AttentionEmulator(build_layers(tmp_path_factory.mktemp("layers_merge1"), ATT_MERGE_LOADS=1))


@pytest.mark.parametrize("lengths,nsplit", [((100, 50), 7), ((300, 17), limits.ATT_MAX_SPLITS), ((16, 1), 5),
                                            ((130, 131), 9)])
def test_batched_merge_loads_add_in_the_same_order(emulator, one_split_at_a_time, lengths, nsplit):
    """The merge loads ATT_MERGE_LOADS splits' partials before adding any, masked past the used splits: the output is
    the bits of adding one split at a time, for used splits below, at and above a batch (1, 2, 4, 7, 9, 19),
    sinks and a chunk of 8 heads."""
    outs = []
    for emu in (emulator, one_split_at_a_time):
        rng = np.random.default_rng(sum(lengths) + nsplit)
        k, v = caches(rng, 1, 128, "f32")
        q = rng.standard_normal((len(lengths), 8, 128)).astype(np.float32)
        q_seq = ((np.arange(len(lengths)) + 1) % 2).astype(np.int32)
        sinks = rng.standard_normal(8).astype(np.float32)
        ws = AttentionEmulator.workspace(len(lengths), 8, 128, nsplit)
        outs.append(emu.attention(q, k, v, q_seq, np.asarray(lengths, np.int32), 1 / math.sqrt(128), sinks=sinks,
                                  nsplit=nsplit, workspace=ws, order=3))
        assert emu.errors() == (0, "")
    assert np.isfinite(outs[0]).all()
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


@pytest.fixture(scope="module")
def four_stages(tmp_path_factory):
    """layers.cu with ATT_DECODE_STAGES = 4 (limits.py's is 2): three key tiles copied ahead of the one computed on."""
    return AttentionEmulator(build_layers(tmp_path_factory.mktemp("layers_stages4"), ATT_DECODE_STAGES=4), stages=4)


@pytest.mark.parametrize("cache,hd", [("f32", 128), ("bf16", 64), ("f16", 256)])
@pytest.mark.parametrize("lengths,nsplit", [((300, 17), 1), ((300, 100), 3), ((9, 2), 1)])
def test_the_pipeline_depth_changes_no_bit(emulator, four_stages, cache, hd, lengths, nsplit):
    """The key tiles' copies run ATT_DECODE_STAGES - 1 tiles ahead: 4 stages give the default build's bits, over
    tiles many more than the stages, a partial last tile and fewer tiles than the stages, in shuffled block orders."""
    assert limits.ATT_DECODE_STAGES != 4
    outs = []
    for emu in (emulator, four_stages):
        rng = np.random.default_rng(sum(lengths) + nsplit + hd)
        k, v = caches(rng, 2, hd, cache)
        q = rng.standard_normal((len(lengths), 12, hd)).astype(np.float32)
        q_seq = ((np.arange(len(lengths)) + 1) % 2).astype(np.int32)
        ws = AttentionEmulator.workspace(len(lengths), 12, hd, nsplit)
        outs.append(emu.attention(q, k, v, q_seq, np.asarray(lengths, np.int32), 1 / math.sqrt(hd), nsplit=nsplit,
                                  workspace=ws, order=4))
        assert emu.errors() == (0, "")
    assert np.isfinite(outs[0]).all()
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))

"""Flash attention for prefill (`ops.attention_prefill`, attention_prefill.cu) against `numpy_backend.attention` in
float64 (GPU only).

Passes pack sequences of ragged lengths (1, 17, 64, 65, 300, 1000 rows) out of order, some of them continuation
prefills (their first row at a position > 0, the earlier keys already in the cache); GQA groups 1, 4 and 8; a
sliding window on and off; attention sinks on and off; f32 and bf16 caches; head dims 64, 128 and 256. Cache
positions past each sequence's last row hold NaN, so a read beyond a row's keys shows; outputs start as NaN, so an
unwritten pair shows.

Tolerances: the kernel splits q, the probabilities and an fp32 cache's K and V into bf16 hi + lo (lo * lo dropped),
with fp32 accumulation and softmax. A lane-by-lane NumPy emulation of the kernel (its fragment layouts, the bf16
roundings, float64 sums) gives relative errors of 2e-6 to 5e-6 over the whole output and at worst 1.1e-5 for one
(row, head); fp32 sums add about 1e-6. Plain bf16 operands would give 3e-3 and 8e-3; a wrong tile, mask or fragment
gives O(1).
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda.test_gpu_kernels import f64, nan_like, rel, to_device_dtype

WHOLE_TOL = 5e-5     # ||out - ref|| / ||ref|| over the whole output
PAIR_TOL = 5e-4      # the same for each (row, head) alone

# sequence -> (new rows, position of the first one): fresh prefills and continuations (earlier keys cached)
SPANS = {0: (1, 0), 1: (17, 0), 2: (64, 0), 3: (65, 40), 4: (300, 700), 5: (1000, 0)}
ORDER = [3, 0, 5, 1, 4, 2]


def packed_pass(spans, order):
    """q_seq, q_len (causal: position + 1) of a pass packing each sequence's new rows in `order`."""
    seq, lens = [], []
    for s in order:
        n, start = spans[s]
        seq += [s] * n
        lens += list(range(start + 1, start + n + 1))
    return np.array(seq, np.int32), np.array(lens, np.int32)


def caches(cp, rng, spans, nkv, hd, cdt):
    """K and V caches [S, capacity, nkv, hd] of random keys up to each sequence's last new row, NaN past it."""
    cap = max(n + start for n, start in spans.values()) + 8
    kv = []
    for _ in range(2):
        c = rng.standard_normal((len(spans), cap, nkv, hd)).astype(np.float32)
        for s, (n, start) in spans.items():
            c[s, start + n:] = np.nan
        kv.append(to_device_dtype(cp, c, cdt))
    return kv


def pair_errors(out, expected) -> np.ndarray:
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    return np.linalg.norm(out - expected, axis=-1) / np.maximum(np.linalg.norm(expected, axis=-1), 1e-30)


def check(cp, rng, *, group, hd, cdt, window=0, with_sinks=False, spans=SPANS, order=ORDER, nkv=2, via=None):
    q_seq, q_len = packed_pass(spans, order)
    kc, vc = caches(cp, rng, spans, nkv, hd, cdt)
    nh = nkv * group
    q = rng.standard_normal((q_seq.size, nh, hd)).astype(np.float32)
    sinks = rng.uniform(-1.0, 3.0, nh).astype(np.float32) if with_sinks else None
    scale = hd ** -0.5
    exp = nb.attention(f64(q), f64(kc.get()), f64(vc.get()), q_seq, q_len, scale, window=window,
                       sinks=None if sinks is None else f64(sinks))
    run = via or ops.attention_prefill
    out = run(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), scale, window=window,
              sinks=None if sinks is None else cp.asarray(sinks), out=nan_like(cp, q.shape))
    got = out.get()
    assert rel(got, exp) < WHOLE_TOL
    errs = pair_errors(got, exp)
    worst = np.unravel_index(int(np.argmax(errs)), errs.shape)
    assert errs.max() < PAIR_TOL, f"(row, head) {worst}: seq {q_seq[worst[0]]}, len {q_len[worst[0]]}"


@pytest.mark.parametrize("cdt", ["f32", "bf16"])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_prefill_attention_matches_numpy(cp, rng, cdt, hd, group, window, with_sinks):
    check(cp, rng, group=group, hd=hd, cdt=cdt, window=window, with_sinks=with_sinks)


@pytest.mark.parametrize("cdt", ["f32", "bf16"])
@pytest.mark.parametrize("window", [0, 33])
def test_head_dim_256(cp, rng, cdt, window):
    check(cp, rng, group=4, hd=256, cdt=cdt, window=window, with_sinks=True,
          spans={0: (65, 0), 1: (300, 129), 2: (17, 0)}, order=[1, 2, 0])


@pytest.mark.parametrize("group", [3, 6])       # groups that do not divide a tile's 64 pairs
def test_tiles_split_rows_between_heads(cp, rng, group):
    check(cp, rng, group=group, hd=128, cdt="bf16", spans={0: (50, 0), 1: (129, 10)}, order=[0, 1])


@pytest.mark.parametrize("cdt", ["f32", "bf16"])
def test_decode_shaped_passes(cp, rng, cdt):
    """40 sequences of one row each (a decode step beyond 32 rows, which the opt-in also sends here): tiles of one
    row's group of heads, most of each block's pairs idle."""
    spans = {s: (1, int(start)) for s, start in enumerate(rng.integers(0, 500, 40))}
    check(cp, rng, group=8, hd=128, cdt=cdt, window=64, with_sinks=True, spans=spans, order=list(range(40)))


def test_a_sequence_split_into_two_spans(cp, rng):
    """Rows of one sequence on both sides of another's: two spans, two key ranges of one cache sequence."""
    q_seq = np.array([0] * 40 + [1] * 70 + [0] * 30, np.int32)
    q_len = np.array(list(range(1, 41)) + list(range(1, 71)) + list(range(41, 71)), np.int32)
    spans = {0: (70, 0), 1: (70, 0)}
    kc, vc = caches(cp, rng, spans, 2, 128, "f32")
    q = rng.standard_normal((q_seq.size, 8, 128)).astype(np.float32)
    exp = nb.attention(f64(q), f64(kc.get()), f64(vc.get()), q_seq, q_len, 0.1)
    out = ops.attention_prefill(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), 0.1,
                                out=nan_like(cp, q.shape))
    assert rel(out.get(), exp) < WHOLE_TOL and pair_errors(out.get(), exp).max() < PAIR_TOL


def calls_of_attention_prefill(monkeypatch) -> list:
    """Counts the calls of ops.attention_prefill from now on (the backend and ops.attention look it up by name)."""
    calls, real = [], ops.attention_prefill

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "attention_prefill", counted)
    return calls


def test_opt_in_through_ops_attention_and_the_backend(cp, rng, monkeypatch):
    """ops.attention(flash_prefill=True) and CupyBackend(flash_prefill=True) run it beyond 32 rows; the defaults, and
    decode-sized passes, run today's kernels."""
    from colibri_format.runtime.cuda.backend import CupyBackend
    from colibri_format.runtime.forward import Workspace

    calls = calls_of_attention_prefill(monkeypatch)

    def flash(*args, **kw):
        return ops.attention(*args, flash_prefill=True, **kw)

    check(cp, rng, group=4, hd=128, cdt="f32", with_sinks=True, via=flash)
    assert len(calls) == 1
    be = CupyBackend(flash_prefill=True)
    assert not CupyBackend().flash_prefill

    def backend(q, kc, vc, q_seq, q_len, scale, *, window, sinks, out):
        return be.attention(q, kc, vc, q_seq, q_len, scale, window=window, out=out, ws=Workspace(be),
                            max_len=kc.shape[1], sinks=sinks)

    check(cp, rng, group=8, hd=64, cdt="f32", window=100, via=backend)
    assert len(calls) == 2
    check(cp, rng, group=4, hd=128, cdt="bf16", spans={0: (20, 5), 1: (12, 0)}, order=[0, 1], via=backend)
    check(cp, rng, group=4, hd=128, cdt="bf16", via=ops.attention)
    assert len(calls) == 2, "32 rows (decode-sized) or the default flag: today's kernels"


def test_the_wrapper_refuses_what_the_kernel_cannot_run(cp):
    q = cp.zeros((40, 8, 128), cp.float32)
    kc = cp.zeros((2, 64, 2, 128), cp.float32)
    seq, lens = cp.zeros(40, cp.int32), cp.arange(1, 41, dtype=cp.int32)
    with pytest.raises(TypeError):
        ops.attention_prefill(q, kc.astype(cp.float16), kc.astype(cp.float16), seq, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        ops.attention_prefill(cp.zeros((40, 8, 96), cp.float32), cp.zeros((2, 64, 2, 96), cp.float32),
                              cp.zeros((2, 64, 2, 96), cp.float32), seq, lens, 0.1)
    with pytest.raises(ValueError, match="out of range"):
        ops.attention_prefill(q, kc, kc, seq, lens + 64, 0.1)
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.attention_prefill(cp.zeros((40, 16, 128), cp.float32)[:, ::2], kc, kc, seq, lens, 0.1)


def test_engine_runs_prefills_on_it(tmp_path, monkeypatch):
    """EngineConfig(flash_prefill=True), the default: a batched prefill of 167 rows (GQA 4, sinks, a window on layer
    0) runs it on every layer, over tile plans made from the host rows once per window (not per layer), and gives
    logits as close to the float64 NumPy engine's as attention_split does (flash_prefill=False)."""
    from colibri_format.runtime import Engine, EngineConfig
    from tests.runtime.numpy_tiny import random_weights
    from tests.runtime.tiny_weights import write_colibri

    weights = random_weights(seed=7, hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             attention_sinks=True, sliding_window=40, sliding_layers=[0], num_layers=3,
                             moe_layers=[0, 1, 2])
    rng = np.random.default_rng(7)
    for i in range(weights.model["num_layers"]):
        weights.dense[f"layers.{i}.attn.sinks"] = rng.uniform(-1.0, 3.0, 8).astype(np.float32)
    path = write_colibri(weights, tmp_path / "flash.colibri", experts="int8_row")
    prompts = [rng.integers(0, 50, n).tolist() for n in (100, 7, 60)]
    cuda = dict(device="cuda", max_seq_len=128)
    with (Engine(path, EngineConfig(**cuda)) as flash, Engine(path, EngineConfig(**cuda, flash_prefill=False)) as today,
          Engine(path, EngineConfig(precision="float64")) as ref):
        assert flash.be.flash_prefill and not today.be.flash_prefill
        expected = ref.logits(prompts)
        base = today.logits(prompts)
        calls = calls_of_attention_prefill(monkeypatch)
        plans = []
        real_plan = ops.prefill_attention_plan_on_device
        monkeypatch.setattr(ops, "prefill_attention_plan_on_device", lambda *a: plans.append(a[3]) or real_plan(*a))
        got = flash.logits(prompts)
        assert len(calls) == weights.model["num_layers"] > len(plans)
        assert sorted(plans) == sorted({flash.args.window(i) for i in range(weights.model["num_layers"])})
        for g, b, e in zip(got, base, expected):
            assert rel(g, e) < max(2e-3, 2 * rel(b, e))


def test_a_replayed_prefill_keeps_its_tile_plan_past_other_passes(cp, tmp_path):
    """A fresh prompt's prefill replays as a graph that reads its flash tile plan at every replay: an eager pass of
    other rows in between (several sequences: a plan of its own), then memory handed out and overwritten, must not
    touch it. The plan lived in the backend once, replaced and freed by the next pass of other rows: on the H200
    (session 25) a captured 512-row prefill replayed after an eager 4096-row one hit an illegal address."""
    from colibri_format.runtime import Engine, EngineConfig
    from tests.runtime.numpy_tiny import random_weights
    from tests.runtime.tiny_weights import write_colibri

    weights = random_weights(seed=8, hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             num_layers=2, moe_layers=[0, 1])
    path = write_colibri(weights, tmp_path / "replay.colibri", experts="int8_row")
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, 50, 40).tolist()
    others = [rng.integers(0, 50, n).tolist() for n in (90, 33)]
    with Engine(path, EngineConfig(device="cuda", max_seq_len=128)) as eng:
        # eager, then captured, then replayed
        first = [eng.be.to_host(eng._prefill_fresh([np.asarray(prompt)])).copy() for _ in range(3)]
        assert eng.stats()["prefill_graphs"]["64"] == "captured"
        eng.logits(others)                                          # eager: a tile plan of other rows
        junk = [cp.full(n, -1, cp.int32) for n in range(1, 4096, 7)]   # reuse whatever was freed
        again = eng.be.to_host(eng._prefill_fresh([np.asarray(prompt)])).copy()
        del junk
    np.testing.assert_array_equal(first[1], first[0])
    np.testing.assert_array_equal(again, first[2])

"""Routing traces (format, untrusted input) and the cache simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri_format.errors import InvalidInput
from colibri_format.runtime.cache.expert_cache import ExpertCache
from colibri_format.runtime.cache.cachesim import (DEFAULT_POLICIES, PolicySpec, parse_capacities, parse_lags,
                                             parse_policies, run_cache_sim, simulate, synthetic_trace, top_experts)
from colibri_format.runtime.cache.trace import (Trace, TraceRecord, TraceWriter, access_sequence, make_header,
                                          read_trace, write_trace)

HEADER = {"colibri_trace": 1, "num_layers": 4, "moe_layers": [1, 3], "num_experts": 8, "top_k": 2,
          "model": "mixtral"}


def write_lines(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


# --- trace format ---------------------------------------------------------------------------------
def test_writer_round_trip(tmp_path):
    p = tmp_path / "t.jsonl"
    with TraceWriter(p, num_layers=4, moe_layers=[1, 3], num_experts=8, top_k=2, model="mixtral") as w:
        # prefill of seq 0 (3 tokens) and seq 1 (1 token) in pass 0, layer-major as an engine does it
        w.record(0, 0, 1, np.array([[1, 2], [3, 4], [5, 6]]), pos=0)
        w.record(0, 1, 1, [7, 0], pos=0)
        w.record(0, 0, 3, np.array([[0, 1], [2, 3], [4, 5]]))
        w.record(0, 1, 3, [6, 7])
        w.record(1, 0, 1, [2])          # decode pass, one call per token
        w.record(1, 0, 3, np.int64([5, 1]))
    tr = read_trace(p)
    assert tr.header == make_header(4, [1, 3], 8, 2, "mixtral")
    assert tr.records == [
        TraceRecord(0, 0, 0, ((1, (1, 2)), (3, (0, 1)))),
        TraceRecord(0, 0, 1, ((1, (3, 4)), (3, (2, 3)))),
        TraceRecord(0, 0, 2, ((1, (5, 6)), (3, (4, 5)))),
        TraceRecord(0, 1, 0, ((1, (7, 0)), (3, (6, 7)))),
        TraceRecord(1, 0, None, ((1, (2,)), (3, (5, 1)))),
    ]
    first = json.loads(p.read_text().splitlines()[0])
    assert first == HEADER


record_st = st.builds(
    lambda t, seq, layers: (t, seq, layers),
    st.integers(0, 3), st.integers(0, 3),
    st.fixed_dictionaries({}, optional={1: st.lists(st.integers(0, 7), min_size=1, max_size=2, unique=True),
                                        3: st.lists(st.integers(0, 7), min_size=1, max_size=2, unique=True)}))


@settings(max_examples=60, deadline=None)
@given(raw=st.lists(record_st, max_size=20))
def test_write_read_round_trip(tmp_path_factory, raw):
    raw.sort(key=lambda r: r[0])
    header = make_header(4, [1, 3], 8, 2, "x")
    recs = [TraceRecord(t, s, None, tuple((l, tuple(es)) for l, es in sorted(layers.items())))
            for t, s, layers in raw]
    p = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_trace(Trace(header, recs), p)
    assert read_trace(p) == Trace(header, recs)


def test_synthetic_round_trip(tmp_path):
    tr = synthetic_trace(3, 16, 4, 50, skew=1.2, locality=0.5, seed=7, batch=2)
    write_trace(tr, tmp_path / "s.jsonl")
    assert read_trace(tmp_path / "s.jsonl") == tr


GOOD = {"t": 0, "seq": 0, "experts": [[1, [0, 1]], [3, [2]]]}


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"t": 0, "seq": 0, "experts": [[2, [0]]]}, "layer 2 is not a MoE layer"),
    ({"t": 0, "seq": 0, "experts": [[9, [0]]]}, "layer 9 out of range"),
    ({"t": 0, "seq": 0, "experts": [[1, [8]]]}, "expert 8 out of range"),
    ({"t": 0, "seq": 0, "experts": [[1, [-1]]]}, "expert -1 out of range"),
    ({"t": 0, "seq": 0, "experts": [[1, [0, 1, 2]]]}, "3 experts"),
    ({"t": 0, "seq": 0, "experts": [[1, [4, 4]]]}, "repeated expert"),
    ({"t": 0, "seq": 0, "experts": [[1, []]]}, "0 experts"),
    ({"t": 0, "seq": 0, "experts": [[1, ["3"]]]}, "must be an integer"),
    ({"t": 0, "seq": 0, "experts": [[1, [1.0]]]}, "must be an integer"),
    ({"t": 0, "seq": 0, "experts": [[1, [True]]]}, "must be an integer"),
    ({"t": 0, "seq": 0, "experts": [[3, [1]], [1, [2]]]}, "ascending"),
    ({"t": 0, "seq": 0, "experts": [[1, [1]], [1, [2]]]}, "ascending"),
    ({"t": 0, "seq": 0, "experts": [[1, [1], 5]]}, "each experts item"),
    ({"t": 0, "seq": 0, "experts": {"1": [1]}}, "experts must be a list"),
    ({"t": -1, "seq": 0, "experts": []}, "t -1 out of range"),
    ({"t": 0, "experts": []}, "missing 'seq'"),
    ({"t": 0, "seq": 0, "experts": [], "extra": 1}, "unknown keys"),
    ({"t": 0, "seq": 0, "pos": "a", "experts": []}, "pos must be an integer"),
    ('{"t": NaN, "seq": 0, "experts": []}', "not valid JSON"),
    ('{"t": 1e400, "seq": 0, "experts": []}', "t must be an integer"),
    ("", "blank line"),
])
def test_bad_lines_name_their_line(tmp_path, line, message):
    p = write_lines(tmp_path / "bad.jsonl", [HEADER, GOOD, GOOD, line])
    with pytest.raises(InvalidInput, match="trace line 4: .*" + message.replace("[", r"\[")) as err:
        read_trace(p)
    assert err.value.field == "line 4"
    assert err.value.offset == len("".join(json.dumps(x) + "\n" for x in (HEADER, GOOD, GOOD)))


def test_time_must_not_go_backwards(tmp_path):
    p = write_lines(tmp_path / "bad.jsonl", [HEADER, dict(GOOD, t=5), dict(GOOD, t=4)])
    with pytest.raises(InvalidInput, match="trace line 3: t=4 goes backwards"):
        read_trace(p)


@pytest.mark.parametrize("header, message", [
    ({**HEADER, "colibri_trace": 2}, "not a colibri trace header"),
    ({**HEADER, "colibri_trace": True}, "not a colibri trace header"),
    ({k: v for k, v in HEADER.items() if k != "top_k"}, "lacks 'top_k'"),
    ({**HEADER, "moe_layers": [3, 1]}, "strictly ascending"),
    ({**HEADER, "moe_layers": []}, "moe_layers is empty"),
    ({**HEADER, "moe_layers": [4]}, "moe layer 4 out of range"),
    ({**HEADER, "num_experts": 0}, "num_experts 0 out of range"),
    ({**HEADER, "num_experts": 1 << 40}, "num_experts"),
    ({**HEADER, "top_k": 9}, "top_k 9 out of range"),
    ({**HEADER, "model": 5}, "model must be a string"),
])
def test_bad_headers(tmp_path, header, message):
    p = write_lines(tmp_path / "bad.jsonl", [header, GOOD])
    with pytest.raises(InvalidInput, match="trace line 1: .*" + message):
        read_trace(p)


def test_size_caps(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [HEADER, GOOD])
    with pytest.raises(InvalidInput, match="over the 10-byte cap"):
        read_trace(p, max_bytes=10)
    p = write_lines(tmp_path / "long.jsonl", [HEADER, GOOD, " " * 5000 + json.dumps(GOOD)])
    with pytest.raises(InvalidInput, match="trace line 3: longer than 4096 bytes"):
        read_trace(p, max_line_bytes=4096)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InvalidInput, match="empty trace"):
        read_trace(tmp_path / "empty.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(InvalidInput, match="trace line 1: not valid JSON"):
        read_trace(tmp_path / "bin.jsonl")
    with pytest.raises(InvalidInput, match="not a regular file"):
        read_trace(tmp_path)
    with pytest.raises(InvalidInput, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")


def test_writer_rejects_bad_records(tmp_path):
    w = TraceWriter(tmp_path / "w.jsonl", num_layers=4, moe_layers=[1, 3], num_experts=8, top_k=2)
    with pytest.raises(InvalidInput, match="not a MoE layer"):
        w.record(0, 0, 2, [1])
    with pytest.raises(InvalidInput, match="out of range"):
        w.record(0, 0, 1, [8])
    w.record(3, 0, 1, [1])
    with pytest.raises(InvalidInput, match="goes backwards"):
        w.record(2, 0, 1, [1])
    w.close()


# --- access sequences -----------------------------------------------------------------------------
def _trace() -> Trace:
    h = make_header(4, [1, 3], 8, 2)
    return Trace(h, [TraceRecord(0, 0, 0, ((1, (1, 2)), (3, (0, 1)))),
                     TraceRecord(0, 1, 0, ((1, (2, 5)), (3, (7,)))),
                     TraceRecord(4, 0, 1, ((1, (1, 2)),))])


def test_access_sequence_orders_and_dedups():
    acc = access_sequence(_trace())
    assert acc.pairs() == [(1, 1), (1, 2), (1, 5), (3, 0), (3, 1), (3, 7), (1, 1), (1, 2)]
    assert acc.step.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    raw = access_sequence(_trace(), dedup=False)
    assert raw.pairs() == [(1, 1), (1, 2), (1, 2), (1, 5), (3, 0), (3, 1), (3, 7), (1, 1), (1, 2)]
    per = access_sequence(_trace(), "per_layer")
    assert per[1].pairs() == [(1, 1), (1, 2), (1, 5), (1, 1), (1, 2)] and per[1].step.tolist() == [0, 0, 0, 1, 1]
    assert per[3].pairs() == [(3, 0), (3, 1), (3, 7)]
    with pytest.raises(InvalidInput):
        access_sequence(_trace(), "layers")


# --- simulator ------------------------------------------------------------------------------------
def replay_with_expert_cache(tr: Trace, spec: PolicySpec, cap: int, scope: str) -> int:
    acc = access_sequence(tr)
    pairs = acc.pairs()
    kw = {}
    if spec.policy == "static":
        idx = {l: i for i, l in enumerate(tr.header.moe_layers)}
        keys = np.array([idx[l] * tr.header.num_experts + e for l, e in pairs])
        parts = np.array([idx[l] for l, _ in pairs]) if scope == "per_layer" else None
        inv = {i: l for l, i in idx.items()}
        kw["pinned"] = [(inv[k // tr.header.num_experts], k % tr.header.num_experts)
                        for k in top_experts(keys, cap, parts)]
    if spec.policy == "belady":
        kw["future"] = pairs
    cache = ExpertCache(cap, policy=spec.policy, scope=scope, decay=spec.decay, clock=spec.clock,
                        history=spec.history, **kw)
    step = -1
    for (layer, expert), s in zip(pairs, acc.step.tolist()):
        while step < s:
            cache.begin_token()
            step += 1
        cache.get(layer, expert, loader=lambda: None)
    return cache.stats().misses


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.integers(1, 20), per_layer=st.booleans(),
       which=st.integers(0, len(DEFAULT_POLICIES) - 1), batch=st.integers(1, 3))
def test_simulator_matches_expert_cache(seed, cap, per_layer, which, batch):
    tr = synthetic_trace(3, 8, 2, 30, skew=1.0, locality=0.4, seed=seed, batch=batch)
    spec = DEFAULT_POLICIES[which]
    scope = "per_layer" if per_layer else "global"
    cap = min(cap, 8) if per_layer else cap
    res = run_cache_sim(tr, str(cap), spec.text, scope)
    assert res["rows"][0]["misses"] == replay_with_expert_cache(tr, spec, cap, scope)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), frac=st.sampled_from(["10%", "25%", "40%", "60%"]),
       per_layer=st.booleans(), skew=st.sampled_from([0.0, 0.8, 1.5]), locality=st.sampled_from([0.0, 0.5]))
def test_belady_beats_every_policy_on_traces(seed, frac, per_layer, skew, locality):
    tr = synthetic_trace(4, 16, 2, 60, skew=skew, locality=locality, seed=seed)
    res = run_cache_sim(tr, frac, "all", "per_layer" if per_layer else "global")
    best = next(r["misses"] for r in res["rows"] if r["policy"] == "belady")
    assert all(best <= r["misses"] for r in res["rows"])
    cold = res["trace"]["distinct_experts"]
    assert all(r["misses"] >= cold or r["policy"] == "static" for r in res["rows"])
    assert best >= cold


def test_run_cache_sim_from_file(tmp_path):
    tr = synthetic_trace(4, 8, 2, 40, seed=1)
    write_trace(tr, tmp_path / "t.jsonl")
    res = run_cache_sim(tmp_path / "t.jsonl", "25%,50%,6", "lru,lrfu:0.9:token,belady", "global", blob_bytes=1000)
    assert res["trace"]["accesses"] == 4 * 2 * 40 and res["trace"]["num_experts"] == 8
    assert [(r["label"], r["capacity"]) for r in res["rows"]] == [
        ("lru", 8), ("lru", 16), ("lru", 6), ("lrfu d=0.9/token", 8), ("lrfu d=0.9/token", 16),
        ("lrfu d=0.9/token", 6), ("belady", 8), ("belady", 16), ("belady", 6)]
    for r in res["rows"]:
        assert r["bytes_paged"] == 1000 * r["misses"] and r["hits"] + r["misses"] == r["accesses"]
        assert r["miss_rate"] == pytest.approx(r["misses"] / r["accesses"])
    json.dumps(res)  # the --json output is plain JSON
    per = run_cache_sim(tr, "50%", "lru", "per_layer")
    assert per["rows"][0]["capacity"] == 4  # 50% of one layer's 8 experts
    # full capacity: only cold misses
    full = run_cache_sim(tr, "100%", "all", "global")
    assert {r["misses"] for r in full["rows"]} == {full["trace"]["distinct_experts"]}


@pytest.mark.parametrize("spec", ["", "0", "-5", "0%", "150%", "ten", "10%%", "1.5"])
def test_bad_capacities(spec):
    with pytest.raises(InvalidInput):
        parse_capacities(spec, 64)


def test_capacities():
    assert parse_capacities("10%, 25%,40%,60%,7", 64) == [("10%", 6), ("25%", 16), ("40%", 26), ("60%", 38),
                                                         ("7", 7)]
    assert parse_capacities("0.1%", 64) == [("0.1%", 1)]


@pytest.mark.parametrize("spec", ["", "fifo", "lrfu:2", "lrfu:0", "lrfu:x", "lrfu:0.9:wall", "lru:0.9", "lru+hist",
                                  "lrfu:0.9:token:x"])
def test_bad_policies(spec):
    with pytest.raises(InvalidInput):
        parse_policies(spec)


def test_policies():
    assert parse_policies("all") == list(DEFAULT_POLICIES)
    assert [parse_policies(p.text) for p in DEFAULT_POLICIES] == [[p] for p in DEFAULT_POLICIES]
    assert parse_policies("lfu+hist,lrfu+hist:0.9:token") == [PolicySpec("lfu", history=True),
                                                              PolicySpec("lrfu", 0.9, "token", True)]
    assert parse_policies("lru, lrfu, lrfu:0.5:token") == [PolicySpec("lru"), PolicySpec("lrfu", 0.999, "access"),
                                                           PolicySpec("lrfu", 0.5, "token")]
    with pytest.raises(InvalidInput):
        run_cache_sim(synthetic_trace(1, 4, 1, 3), "50%", "lru", "layer")
    with pytest.raises(InvalidInput):
        run_cache_sim(synthetic_trace(1, 4, 1, 3), "50%", "lru", blob_bytes=-1)


# --- synthetic generator --------------------------------------------------------------------------
def test_synthetic_trace_shape_and_determinism():
    a = synthetic_trace(3, 16, 4, 100, skew=1.0, locality=0.5, seed=3, batch=2)
    assert a == synthetic_trace(3, 16, 4, 100, skew=1.0, locality=0.5, seed=3, batch=2)
    assert a != synthetic_trace(3, 16, 4, 100, skew=1.0, locality=0.5, seed=4, batch=2)
    assert len(a.records) == 200 and {r.seq for r in a.records} == {0, 1}
    for r in a.records:
        assert [l for l, _ in r.experts] == [0, 1, 2]
        assert all(len(set(es)) == 4 and all(0 <= e < 16 for e in es) for _, es in r.experts)


def test_synthetic_skew_and_locality():
    flat = access_sequence(synthetic_trace(1, 32, 2, 3000, skew=0.0, seed=1))
    skewed = access_sequence(synthetic_trace(1, 32, 2, 3000, skew=1.5, seed=1))
    top4 = lambda acc: np.sort(np.bincount(acc.expert, minlength=32))[::-1][:4].sum() / len(acc)  # noqa: E731
    assert top4(flat) < 0.2 < 0.5 < top4(skewed)
    # phases: each block of 500 steps has its own favourites
    drift = access_sequence(synthetic_trace(1, 32, 2, 1000, skew=3.0, seed=1, phase=500))
    fav = [np.bincount(drift.expert[drift.step // 500 == i], minlength=32).argmax() for i in (0, 1)]
    assert fav[0] != fav[1]
    sticky = synthetic_trace(1, 32, 2, 500, skew=0.0, locality=1.0, seed=2)
    assert len({r.experts for r in sticky.records}) == 1  # locality 1 keeps the first choice forever


@pytest.mark.parametrize("kwargs", [{"tokens": -1}, {"skew": -1.0}, {"locality": 1.5}, {"batch": 0}, {"phase": -1},
                                    {"top_k": 20}, {"num_experts": 0}])
def test_synthetic_bad_arguments(kwargs):
    args = {"num_layers": 2, "num_experts": 8, "top_k": 2, "tokens": 10, **kwargs}
    with pytest.raises(InvalidInput):
        synthetic_trace(**args)


def test_simulate_100k_accesses_quickly():
    import time
    acc = access_sequence(synthetic_trace(8, 32, 4, 3200, skew=1.0, locality=0.3, seed=5))
    assert len(acc) > 100_000
    t0 = time.process_time()             # CPU seconds: other jobs on a loaded machine stretch only the wall clock
    simulate(acc, 32, PolicySpec("lrfu"), 64)
    assert time.process_time() - t0 < 2.0


# --- publication lag ------------------------------------------------------------------------------
def test_parse_lags():
    assert parse_lags("0, 1,3,fill") == [0, 1, 3, "fill"]
    for bad in ("", "x", "-1", "1.5", "fil"):
        with pytest.raises(InvalidInput):
            parse_lags(bad)


def test_lag_hand_example():
    """One key routed every pass, capacity 1: a miss admits it at pass 0; lag L makes it a hit from pass 1 + L;
    fill: armed for pass 2, filled there (a miss), a hit from pass 4."""
    tr = synthetic_trace(1, 1, 1, 8)
    res = run_cache_sim(tr, "1", "lru", lag="0,1,2,3,fill")
    assert [r["misses"] for r in res["rows"]] == [1, 2, 3, 4, 4]
    assert [r["admissions"] for r in res["rows"]] == [1, 1, 1, 1, 1]
    warm = run_cache_sim(tr, "1", "lru", lag="2", warmup=2)
    assert warm["rows"][0]["accesses"] == 6 and warm["rows"][0]["misses"] == 1


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), frac=st.sampled_from(["25%", "50%"]), per_layer=st.booleans(),
       policy=st.sampled_from(["lru", "lrfu+hist:0.999:token", "lfu+hist"]), admission=st.sampled_from(["always",
                                                                                                       "frequency"]))
def test_lag_only_moves_hits(seed, frac, per_layer, policy, admission):
    """The policy sees the same accesses at every lag (same evictions); from lag 1 on (the pipelined engine: an
    eviction reaches the table a pass late), more lag never adds a hit, and fill is never better than lag 3."""
    tr = synthetic_trace(4, 16, 2, 60, skew=1.0, locality=0.3, seed=seed)
    res = run_cache_sim(tr, frac, policy, "per_layer" if per_layer else "global", admission=admission,
                        lag="0,1,2,3,fill")
    rows = res["rows"]
    assert len({r["evictions"] for r in rows}) == 1 and len({r["accesses"] for r in rows}) == 1
    misses = [r["misses"] for r in rows]
    assert misses[1] <= misses[2] <= misses[3] <= misses[4]
    lag0 = run_cache_sim(tr, frac, policy, "per_layer" if per_layer else "global", admission=admission)
    assert rows[0]["misses"] == lag0["rows"][0]["misses"]
    assert rows[0]["admissions"] == rows[1]["admissions"] >= rows[4]["admissions"]

"""Expert cache: every policy against a brute-force reference, slots, scopes, errors."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri_format.errors import ColibriFormatError, InvalidInput
from colibri_format.runtime.cache.expert_cache import (BeladyPolicy, CacheStats, ExpertCache, LFUPolicy, LRFUPolicy,
                                          LRUPolicy, RandomPolicy, StaticPolicy, make_policy, next_use)

# Decays whose powers are never (or only absurdly nearly) a ratio of small integers, so that exact
# scores never tie across different timestamps and float log-space keys order them like Fractions.
DECAYS = [1.0, 0.999, 0.97531, 0.8765432, 0.61803, 0.123457, 1e-6]
FAST = settings(max_examples=150, deadline=None)

keys_st = st.lists(st.integers(0, 7), min_size=0, max_size=120)


def token_clock(n: int, data: st.DataObject) -> list[int]:
    """A nondecreasing clock: each access starts a new token with probability 1/2."""
    steps = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    out, t = [], 0
    for s in steps:
        t += s
        out.append(t)
    return out


# --- brute-force references -----------------------------------------------------------------------
class RefCache:
    """O(n) scan per eviction, the literal definitions; returns (hit, victim) per access."""

    def __init__(self, policy: str, capacity: int | None, decay: float = 1.0, history: bool = False) -> None:
        self.policy, self.capacity, self.decay = policy, capacity, Fraction(decay)
        self.res: dict[int, list] = {}  # key -> [count, last clock, last seq]
        self.seq = 0
        self.history = history
        self.all_counts: dict[int, int] = {}  # every access ever, per key

    def score(self, key: int, now: int):
        count, last, seq = self.res[key]
        if self.policy == "lru":
            return (seq,)
        if self.policy == "lfu":
            return (count, seq)
        return (count * self.decay ** (now - last), seq)  # lrfu, exact

    def access(self, key: int, now: int) -> tuple[bool, int | None]:
        self.seq += 1
        self.all_counts[key] = self.all_counts.get(key, 0) + 1
        if key in self.res:
            e = self.res[key]
            e[0] += 1
            e[1], e[2] = now, self.seq
            return True, None
        victim = None
        if self.capacity is not None and len(self.res) >= self.capacity:
            victim = min(self.res, key=lambda k: self.score(k, now))
            del self.res[victim]
        self.res[key] = [self.all_counts[key] if self.history else 1, now, self.seq]
        return False, victim


def run_policy(policy, keys, clocks):
    out = []
    for k, now in zip(keys, clocks):
        if policy.touch(k, now):
            out.append((True, None))
            continue
        victim = policy.insert(k, now) if policy.admits(k) else "bypass"
        out.append((False, victim))
    return out


def optimal_misses(keys: list[int], capacity: int) -> int:
    """Exhaustive search over every cache content (bypass allowed): the true optimum."""
    states = {frozenset(): 0}
    for k in keys:
        nxt: dict[frozenset, int] = {}

        def put(s, m):
            if nxt.get(s, 1 << 30) > m:
                nxt[s] = m

        for s, m in states.items():
            if k in s:
                put(s, m)
                continue
            put(s, m + 1)  # bypass
            if len(s) < capacity:
                put(s | {k}, m + 1)
            else:
                for v in s:
                    put((s - {v}) | {k}, m + 1)
        states = nxt
    return min(states.values())


# --- each policy equals its reference -------------------------------------------------------------
@FAST
@given(keys=keys_st, cap=st.integers(1, 6))
def test_lru_matches_reference(keys, cap):
    ref = RefCache("lru", cap)
    assert run_policy(LRUPolicy(cap), keys, range(len(keys))) == [ref.access(k, i) for i, k in enumerate(keys)]


@FAST
@given(keys=keys_st, cap=st.integers(1, 6), data=st.data())
def test_lfu_matches_reference(keys, cap, data):
    clocks = token_clock(len(keys), data)
    ref = RefCache("lfu", cap)
    assert run_policy(LFUPolicy(cap), keys, clocks) == [ref.access(k, t) for k, t in zip(keys, clocks)]


@FAST
@given(keys=keys_st, cap=st.integers(1, 6), decay=st.sampled_from(DECAYS), token=st.booleans(),
       data=st.data())
def test_lrfu_matches_exact_reference(keys, cap, decay, token, data):
    clocks = token_clock(len(keys), data) if token else list(range(len(keys)))
    ref = RefCache("lrfu", cap, decay)
    assert run_policy(LRFUPolicy(cap, decay), keys, clocks) == [ref.access(k, t) for k, t in zip(keys, clocks)]


@FAST
@given(keys=keys_st, cap=st.integers(1, 6), decay=st.sampled_from(DECAYS), token=st.booleans(),
       data=st.data())
def test_history_counts_match_reference(keys, cap, decay, token, data):
    clocks = token_clock(len(keys), data) if token else list(range(len(keys)))
    ref = RefCache("lfu", cap, history=True)
    assert run_policy(LFUPolicy(cap, history=True), keys, clocks) == [ref.access(k, t) for k, t in zip(keys, clocks)]
    ref = RefCache("lrfu", cap, decay, history=True)
    assert run_policy(LRFUPolicy(cap, decay, history=True), keys, clocks) == [ref.access(k, t) for k, t in
                                                                              zip(keys, clocks)]


def test_in_cache_counts_degenerate_on_a_cyclic_sweep():
    # each step touches hot keys 0, 1 and four cold keys from a rotating pool of 8: 6 keys > 4 slots.
    # In-cache LFU never accumulates a count, so it behaves like LRU (every access misses); with
    # history the hot keys' counts grow even while they miss, and they stay resident.
    keys = [k for t in range(50) for k in [0, 1] + [2 + (4 * t + j) % 8 for j in range(4)]]

    def misses(p):
        return sum(not h for h, _ in run_policy(p, keys, range(len(keys))))

    assert misses(LRUPolicy(4)) == misses(LFUPolicy(4)) == misses(LRFUPolicy(4, 0.999)) == len(keys)
    assert misses(LFUPolicy(4, history=True)) <= 4 * 50 + 8  # only the cold keys miss, after warm-up


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, 6), max_size=400), cap=st.integers(1, 4), decay=st.sampled_from(DECAYS))
def test_lrfu_heap_compaction_keeps_order(keys, cap, decay):
    # long sequences over few keys force many heap compactions
    ref = RefCache("lrfu", cap, decay)
    assert run_policy(LRFUPolicy(cap, decay), keys, range(len(keys))) == [ref.access(k, i) for i, k in
                                                                          enumerate(keys)]


def test_lrfu_score_is_the_literal_formula():
    p = LRFUPolicy(4, 0.9)
    for now, k in enumerate([1, 1, 2, 1, 3]):
        if not p.touch(k, now):
            p.insert(k, now)
    assert p.score(1, 10) == pytest.approx(3 * 0.9 ** (10 - 3))
    assert p.score(2, 10) == pytest.approx(1 * 0.9 ** (10 - 2))


@FAST
@given(keys=keys_st, cap=st.integers(1, 6), data=st.data())
def test_lrfu_decay_one_is_lfu(keys, cap, data):
    clocks = token_clock(len(keys), data)
    assert run_policy(LRFUPolicy(cap, 1.0), keys, clocks) == run_policy(LFUPolicy(cap), keys, clocks)
    # and decay -> 1 behaves the same on sequences this short
    assert run_policy(LRFUPolicy(cap, 1 - 1e-12), keys, clocks) == run_policy(LFUPolicy(cap), keys, clocks)


@FAST
@given(keys=keys_st, cap=st.integers(1, 6))
def test_lrfu_tiny_decay_is_lru(keys, cap):
    # with decay < 1 / len(keys), one tick of recency outweighs any count ratio
    clocks = range(len(keys))
    assert run_policy(LRFUPolicy(cap, 1e-6), keys, clocks) == run_policy(LRUPolicy(cap), keys, clocks)


@FAST
@given(keys=st.lists(st.integers(0, 4), max_size=14), cap=st.integers(1, 3))
def test_belady_is_optimal(keys, cap):
    misses = sum(not hit for hit, _ in run_policy(BeladyPolicy(cap, keys), keys, range(len(keys))))
    assert misses == optimal_misses(keys, cap)


@FAST
@given(keys=keys_st, cap=st.integers(1, 6), decay=st.sampled_from(DECAYS), seed=st.integers(0, 3))
def test_belady_never_worse_than_online_policies(keys, cap, decay, seed):
    def misses(p):
        return sum(not hit for hit, _ in run_policy(p, keys, range(len(keys))))

    best = misses(BeladyPolicy(cap, keys))
    pinned = sorted(set(keys))[:cap]
    for p in (LRUPolicy(cap), LFUPolicy(cap), LRFUPolicy(cap, decay), RandomPolicy(cap, seed),
              StaticPolicy(cap, pinned)):
        assert best <= misses(p), p.name


def test_belady_rejects_a_different_sequence():
    p = BeladyPolicy(2, [1, 2, 3])
    p.touch(1, 0)
    with pytest.raises(InvalidInput, match="future sequence"):
        p.touch(3, 1)


def test_next_use():
    assert next_use([5, 6, 5, 5]) == [2, 4 + 1, 3, 4 + 3]


@FAST
@given(keys=keys_st, cap=st.integers(1, 6), seed=st.integers(0, 5))
def test_random_policy_respects_capacity(keys, cap, seed):
    p = RandomPolicy(cap, seed)
    resident: set[int] = set()
    for i, k in enumerate(keys):
        hit = p.touch(k, i)
        assert hit == (k in resident)
        if not hit:
            v = p.insert(k, i)
            if v is not None:
                resident.remove(v)
            resident.add(k)
        assert len(p) == len(resident) <= cap and all(r in p for r in resident)


# --- static ---------------------------------------------------------------------------------------
def test_static_pins_and_bypasses():
    loads = []
    cache = ExpertCache(2, policy="static", pinned=[(0, 1), (1, 3)])
    for key in [(0, 1), (0, 2), (0, 1), (1, 3), (0, 2), (1, 3)]:
        cache.get(*key, loader=lambda key=key: loads.append(key) or key, nbytes=10)
    assert loads == [(0, 1), (0, 2), (1, 3), (0, 2)]  # (0, 2) is never kept
    assert cache.contains(0, 1) and cache.contains(1, 3) and not cache.contains(0, 2)
    assert cache.slot_of(0, 2) is None and {cache.slot_of(0, 1), cache.slot_of(1, 3)} == {0, 1}
    s = cache.stats()
    assert (s.hits, s.misses, s.evictions, s.bytes_paged) == (2, 4, 0, 40)


def test_static_too_many_pins():
    with pytest.raises(InvalidInput, match="do not fit"):
        ExpertCache(1, policy="static", pinned=[(0, 1), (0, 2)])
    # per layer: the capacity is per layer, so two layers of one pin each fit
    ExpertCache(1, policy="static", scope="per_layer", pinned=[(0, 1), (1, 2)])


# --- ExpertCache ----------------------------------------------------------------------------------
POLICY_ARGS = [("lru", {}), ("lfu", {}), ("lrfu", {"decay": 0.9}), ("lrfu", {"decay": 0.999, "clock": "token"}),
               ("random", {"seed": 3})]


@FAST
@given(pairs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=150), cap=st.integers(1, 5),
       which=st.integers(0, len(POLICY_ARGS) - 1), per_layer=st.booleans())
def test_slots_are_reused_and_in_range(pairs, cap, which, per_layer):
    policy, kw = POLICY_ARGS[which]
    evicted = []
    cache = ExpertCache(cap, policy=policy, scope="per_layer" if per_layer else "global",
                        on_evict=lambda l, e, s, v: evicted.append((l, e, s, v)), **kw)
    for i, (layer, expert) in enumerate(pairs):
        if i % 3 == 0:
            cache.begin_token()
        before = len(evicted)
        value = cache.get(layer, expert, loader=lambda: object())
        assert cache.contains(layer, expert)
        slot = cache.slot_of(layer, expert)
        assert 0 <= slot < cap
        if len(evicted) > before:  # the freed slot is the one the new entry got
            el, ee, es, ev = evicted[-1]
            assert es == slot and not cache.contains(el, ee)
        assert cache.get(layer, expert, loader=lambda: pytest.fail("hit expected")) is value
        groups = {}
        for layer2 in range(3):
            for e2 in range(6):
                s = cache.slot_of(layer2, e2)
                if s is not None:
                    groups.setdefault(layer2 if per_layer else None, []).append(s)
        for slots in groups.values():
            assert len(slots) == len(set(slots)) <= cap


@FAST
@given(pairs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=150), cap=st.integers(1, 4))
def test_per_layer_is_one_lru_per_layer(pairs, cap):
    cache = ExpertCache(cap, policy="lru", scope="per_layer")
    for layer, expert in pairs:
        cache.get(layer, expert, loader=lambda: None)
    expected = 0
    for layer in range(4):
        sub = [e for l, e in pairs if l == layer]
        expected += sum(not h for h, _ in run_policy(LRUPolicy(cap), sub, range(len(sub))))
        assert sum(cache.contains(layer, e) for e in range(6)) <= cap
    assert cache.stats().misses == expected


@FAST
@given(pairs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=150), cap=st.integers(1, 4))
def test_global_scope_shares_the_pool(pairs, cap):
    cache = ExpertCache(cap, policy="lru", scope="global")
    for layer, expert in pairs:
        cache.get(layer, expert, loader=lambda: None)
        assert len(cache) <= cap
    assert cache.stats().misses == sum(not h for h, _ in run_policy(LRUPolicy(cap), pairs, range(len(pairs))))


def test_unbounded_never_evicts():
    cache = ExpertCache(None, policy="lrfu")
    for i in range(50):
        cache.get(i % 4, i, loader=lambda: i)
    assert len(cache) == 50 and cache.stats().evictions == 0
    assert sorted(cache.slot_of(i % 4, i) for i in range(50)) == list(range(50))


def test_stats_bytes_and_reset():
    cache = ExpertCache(1, policy="lru")
    cache.get(0, 0, lambda: b"abc", nbytes=len)
    cache.get(0, 0, lambda: b"abc", nbytes=len)
    cache.get(0, 1, lambda: b"abcdef", nbytes=100)
    assert cache.stats() == CacheStats(hits=1, misses=2, evictions=1, bytes_paged=103, hit_rate=1 / 3)
    assert cache.stats().miss_rate == pytest.approx(2 / 3)
    cache.reset_stats()
    assert cache.stats() == CacheStats(0, 0, 0, 0, 0.0)
    assert cache.contains(0, 1)  # residency survives a stats reset


def test_loader_error_leaves_cache_unchanged():
    cache = ExpertCache(1, policy="lrfu")
    cache.get(0, 0, lambda: "a")

    def boom():
        raise OSError("disk")

    with pytest.raises(OSError):
        cache.get(0, 1, boom)
    assert cache.contains(0, 0) and not cache.contains(0, 1) and cache.stats().misses == 1


def test_explicit_evict_and_clear():
    seen = []
    cache = ExpertCache(3, policy="lfu", on_evict=lambda *a: seen.append(a))
    for e in range(3):
        cache.get(0, e, lambda e=e: e)
    assert cache.evict(0, 1) and not cache.evict(0, 1)
    cache.get(0, 7, lambda: 7)
    assert cache.slot_of(0, 7) == seen[0][2]  # freed slot reused
    cache.clear()
    assert len(cache) == 0 and len(seen) == 4


def test_belady_through_expert_cache():
    future = [(0, 1), (1, 1), (0, 2), (0, 1), (1, 1), (0, 2)]
    cache = ExpertCache(2, policy="belady", future=future)
    for l, e in future:
        cache.get(l, e, loader=lambda: None)
    assert cache.stats().misses == optimal_misses(future, 2)


@pytest.mark.parametrize("kwargs, field", [
    ({"capacity": 0}, "capacity"), ({"capacity": -3}, "capacity"), ({"capacity": 2.5}, "capacity"),
    ({"capacity": True}, "capacity"), ({"capacity": 4, "policy": "fifo"}, "policy"),
    ({"capacity": 4, "decay": 0.0}, "decay"), ({"capacity": 4, "decay": 1.5}, "decay"),
    ({"capacity": 4, "decay": float("nan")}, "decay"), ({"capacity": 4, "scope": "layer"}, "scope"),
    ({"capacity": 4, "clock": "time"}, "clock"), ({"capacity": 4, "policy": "static"}, "pinned"),
    ({"capacity": 4, "policy": "belady"}, "future"), ({"capacity": 4, "pinned": [(0, 1)]}, "pinned"),
    ({"capacity": 4, "policy": "static", "pinned": [(0, "x")]}, "pinned"),
    ({"capacity": 4, "policy": "lru", "history": True}, "history"),
])
def test_bad_arguments(kwargs, field):
    with pytest.raises(InvalidInput) as err:
        ExpertCache(**kwargs)
    assert err.value.field == field
    assert isinstance(err.value, ColibriFormatError) and isinstance(err.value, ValueError)


def test_make_policy_names():
    assert [make_policy(n, 2, pinned=[1] if n == "static" else None,
                        future=[1] if n == "belady" else None).name
            for n in ("lru", "lfu", "lrfu", "static", "belady", "random")] == \
        ["lru", "lfu", "lrfu", "static", "belady", "random"]
    with pytest.raises(InvalidInput):
        make_policy("mru", 2)


def test_numpy_integer_capacity():
    np = pytest.importorskip("numpy")
    assert ExpertCache(np.int64(3)).capacity == 3


def test_many_accesses_are_fast():
    import time
    pairs = [(i % 16, (i * 7919) % 64) for i in range(20000)]
    cache = ExpertCache(200, policy="lrfu")
    t0 = time.process_time()             # CPU seconds: other jobs on a loaded machine stretch only the wall clock
    for l, e in itertools.islice(pairs, 20000):
        cache.get(l, e, loader=lambda: None)
    assert time.process_time() - t0 < 2.0


@pytest.mark.parametrize("policy", ["lfu", "lrfu"])
def test_frequency_admission_keeps_a_hot_set_from_one_off_keys(policy):
    cache = ExpertCache(2, policy=policy, history=True, admission="frequency", decay=0.9999)
    for _ in range(3):                       # two hot experts, three accesses each
        for e in (0, 1):
            cache.get(0, e, lambda: "v", nbytes=1)
    cache.get(0, 7, lambda: "v", nbytes=1)   # a one-off: served, not admitted
    assert not cache.contains(0, 7) and cache.slot_of(0, 7) is None
    assert cache.contains(0, 0) and cache.contains(0, 1) and cache.stats().evictions == 0
    for _ in range(4):                       # a key that keeps coming back gets in, evicting a hot one
        cache.get(0, 7, lambda: "v", nbytes=1)
    assert cache.contains(0, 7) and cache.stats().evictions == 1


def test_always_admission_admits_every_miss():
    cache = ExpertCache(2, policy="lfu", history=True)
    for e in (0, 1, 0, 1, 7):
        cache.get(0, e, lambda: "v")
    assert cache.contains(0, 7)


@pytest.mark.parametrize("kwargs", [dict(policy="lru", admission="frequency"),
                                    dict(policy="lfu", admission="frequency", history=False),
                                    dict(policy="lfu", admission="sometimes", history=True)])
def test_frequency_admission_needs_lfu_or_lrfu_with_history(kwargs):
    with pytest.raises(InvalidInput, match="admission"):
        ExpertCache(2, **kwargs)

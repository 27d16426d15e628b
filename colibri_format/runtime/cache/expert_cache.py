"""Expert cache: a fixed pool of slots and the eviction policies shared by the engines and the simulator.

Two layers:

* :class:`CachePolicy` and one small subclass per policy decide *which keys stay resident*. They know
  nothing about values, bytes or slots, and take any hashable key, so the trace simulator
  (`cachesim.py`, integer keys) and the engines (:class:`ExpertCache`, ``(layer, expert)`` keys) run
  exactly the same eviction code.
* :class:`ExpertCache` holds the values, gives every resident entry a slot id in ``[0, capacity)``
  (the CUDA engine maps slots onto a preallocated device pool), counts hits, misses, evictions and
  bytes, and partitions the experts globally or per layer.

Per access the protocol is: ``touch(key, now)`` exactly once (True on a hit); on a miss, if
``admits(key)``, ``insert(key, now)`` returns the evicted key or None. ``now`` is the clock value of
the access (an access counter or a token counter); only LRFU reads it.

Policies
--------
``lru``     evict the least recently used entry.
``lfu``     evict the entry with the fewest accesses (ties go to the least recently used). By default
            counts are in-cache (they restart at 1 on insertion); ``history=True`` keeps the counts
            of evicted keys ("perfect" LFU).
``lrfu``    evict the lowest ``count * decay ** (now - last)`` (the LRFU family of Lee et al.; ``count``
            is the entry's access count, counted as for ``lfu``, ``last`` the clock at its last access).
            Ties go to the least recently used. ``decay = 1`` is exactly ``lfu``; ``decay < 1/N`` on a
            sequence of N accesses is exactly ``lru``.
``static``  a fixed set of pinned keys stays resident once loaded; any other key is served on a miss
            without being inserted.
``belady``  the offline optimum (Belady's MIN with bypass): evict the entry used farthest in the future,
            or do not insert the incoming key when its own next use is the farthest. Needs the whole
            future access sequence; for simulation only.
``random``  evict a uniformly random resident entry (a seeded baseline).

Why LRFU needs no rescoring: for two resident entries x and y,
``c_x d^(now-t_x) < c_y d^(now-t_y)`` iff ``c_x d^(-t_x) < c_y d^(-t_y)`` (divide both sides by the
positive ``d^now``), iff ``log c_x + t_x*lam < log c_y + t_y*lam`` with ``lam = -log d >= 0``. The key
``log c + t*lam`` does not depend on ``now`` and only changes when the entry itself is accessed, so a
min-heap with lazily discarded stale records finds the victim in amortised O(log n).
"""

from __future__ import annotations

import heapq
import math
import operator
import random
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from colibri_format.errors import InvalidInput

T = TypeVar("T")

POLICIES = ("lru", "lfu", "lrfu", "static", "belady", "random")
ENGINE_POLICIES = tuple(p for p in POLICIES if p != "belady")    # belady needs the future: cache-sim only
SCOPES = ("global", "per_layer")
CLOCKS = ("access", "token")
ADMISSIONS = ("always", "frequency")


# --- argument checks ------------------------------------------------------------------------------
def check_capacity(capacity: object) -> int | None:
    """Return ``capacity`` as an int >= 1, or None (unbounded); raise InvalidInput otherwise."""
    if capacity is None:
        return None
    if isinstance(capacity, bool):
        raise InvalidInput("cache capacity must be an integer or None", field="capacity", value=capacity)
    if not isinstance(capacity, int):
        try:
            capacity = operator.index(capacity)  # numpy integers
        except TypeError:
            raise InvalidInput("cache capacity must be an integer or None", field="capacity",
                               value=capacity) from None
    if capacity < 1:
        raise InvalidInput("cache capacity must be at least 1 expert", field="capacity", value=capacity)
    return int(capacity)


def check_decay(decay: object) -> float:
    """Return ``decay`` as a float in (0, 1]; raise InvalidInput otherwise."""
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise InvalidInput("decay must be a number in (0, 1]", field="decay", value=decay)
    d = float(decay)
    if not (0.0 < d <= 1.0):  # also rejects NaN
        raise InvalidInput("decay must be in (0, 1]", field="decay", value=decay)
    return d


def _check_choice(value: object, choices: tuple[str, ...], name: str) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidInput(f"unknown {name} {value!r}; expected one of {', '.join(choices)}",
                           field=name, value=value)
    return value


# --- policies -------------------------------------------------------------------------------------
class CachePolicy:
    """Strategy deciding which keys stay resident; one instance per cache partition.

    Subclasses implement ``touch``, ``insert``, ``remove`` and may override ``admits``. A policy never
    holds more than ``capacity`` keys; ``capacity=None`` means unbounded (never evicts).
    """

    name = "base"

    def __init__(self, capacity: int | None) -> None:
        self.capacity = check_capacity(capacity)

    def touch(self, key: Hashable, now: float) -> bool:
        """Record one access to ``key`` at clock ``now``; return True when it is resident (a hit)."""
        raise NotImplementedError

    def admits(self, key: Hashable) -> bool:
        """After a miss: whether ``key`` should be inserted (False: serve it without caching)."""
        return True

    def insert(self, key: Hashable, now: float) -> Hashable | None:
        """Insert a missing ``key`` accessed at ``now``; return the key evicted to make room, or None."""
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        """Drop a resident ``key`` without counting an eviction (explicit invalidation)."""
        raise NotImplementedError

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def _full(self) -> bool:
        return self.capacity is not None and len(self) >= self.capacity


class LRUPolicy(CachePolicy):
    """Least recently used: an ordered dict, oldest first."""

    name = "lru"

    def __init__(self, capacity: int | None) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable, now: float) -> bool:
        if key in self._order:
            self._order.move_to_end(key)
            return True
        return False

    def insert(self, key: Hashable, now: float) -> Hashable | None:
        victim = None
        if self._full():
            victim, _ = self._order.popitem(last=False)
        self._order[key] = None
        return victim

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class _HeapPolicy(CachePolicy):
    """Evicts the lowest (priority, last access sequence); priority fixed between own accesses.

    ``_entries[key] = [count, seq, priority]``; the heap holds ``(priority, seq, key)`` records, of
    which only the one whose ``seq`` matches the entry is live. ``seq`` is unique per record, so keys
    themselves are never compared.

    ``history=False`` (in-cache counts): a key's count restarts at 1 each time it is inserted.
    ``history=True`` ("perfect" counts): the count of an evicted key is remembered and continues when
    it comes back (memory: one int per distinct key ever seen).

    ``admission="frequency"`` (needs ``history``): a full cache admits a missing key only when its priority
    with this access beats the lowest resident's; a refused key is served without caching and its access still
    counts, so a key that keeps coming back gets in. It keeps a stable hot set from being churned by one-off
    keys, which matters when every admission is a copy that competes with demand reads for the bus.
    """

    def __init__(self, capacity: int | None, history: bool = False, admission: str = "always") -> None:
        super().__init__(capacity)
        self.history = bool(history)
        self.admission = _check_choice(admission, ADMISSIONS, "admission")
        if self.admission == "frequency" and not self.history:
            raise InvalidInput("admission='frequency' needs history=True (a refused key's count must survive)",
                               field="admission", value=admission)
        self._now = 0.0
        self._entries: dict[Hashable, list[Any]] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0
        self._past: dict[Hashable, int] = {}  # evicted key -> its count (history=True only)

    def _priority(self, count: int, now: float) -> float:
        raise NotImplementedError

    def touch(self, key: Hashable, now: float) -> bool:
        self._now = now
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._seq += 1
        count = entry[0] + 1
        prio = self._priority(count, now)
        entry[0], entry[1], entry[2] = count, self._seq, prio
        heapq.heappush(self._heap, (prio, self._seq, key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._compact()
        return True

    def insert(self, key: Hashable, now: float) -> Hashable | None:
        victim = None
        if self._full():
            victim = self._pop_min()
        self._seq += 1
        count = self._past.pop(key, 0) + 1 if self.history else 1
        prio = self._priority(count, now)
        self._entries[key] = [count, self._seq, prio]
        heapq.heappush(self._heap, (prio, self._seq, key))
        return victim

    def admits(self, key: Hashable) -> bool:
        if self.admission == "always" or not self._full():
            return True
        count = self._past.get(key, 0) + 1
        if self._priority(count, self._now) > self._min_record()[0]:
            return True
        self._past[key] = count              # refused: this access still counts towards the next chance
        return False

    def _min_record(self) -> tuple[float, int, Hashable]:
        """The live heap record of lowest priority (stale records on top are dropped)."""
        heap, entries = self._heap, self._entries
        while True:
            prio, seq, key = heap[0]
            entry = entries.get(key)
            if entry is not None and entry[1] == seq:
                return heap[0]
            heapq.heappop(heap)

    def _pop_min(self) -> Hashable:
        heap, entries = self._heap, self._entries
        while True:
            _, seq, key = heapq.heappop(heap)
            entry = entries.get(key)
            if entry is not None and entry[1] == seq:
                del entries[key]
                if self.history:
                    self._past[key] = entry[0]
                return key

    def _compact(self) -> None:
        self._heap = [(e[2], e[1], k) for k, e in self._entries.items()]
        heapq.heapify(self._heap)

    def remove(self, key: Hashable) -> None:
        entry = self._entries.pop(key)  # its heap record becomes stale
        if self.history:
            self._past[key] = entry[0]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class LFUPolicy(_HeapPolicy):
    """Least frequently used; ties go to the least recently used. See ``_HeapPolicy`` for ``history``."""

    name = "lfu"

    def _priority(self, count: int, now: float) -> float:
        return count


class LRFUPolicy(_HeapPolicy):
    """Lowest ``count * decay ** (now - last)`` is evicted, compared in log space (see module doc)."""

    name = "lrfu"

    def __init__(self, capacity: int | None, decay: float = 0.999, history: bool = False,
                 admission: str = "always") -> None:
        super().__init__(capacity, history, admission)
        self.decay = check_decay(decay)
        self._lam = -math.log(self.decay)  # >= 0; 0 when decay == 1 (pure LFU)

    def _priority(self, count: int, now: float) -> float:
        return math.log(count) + now * self._lam

    def score(self, key: Hashable, now: float) -> float:
        """The literal ``count * decay ** (now - last)`` of a resident key (for inspection and tests)."""
        count, _, prio = self._entries[key]
        last = (prio - math.log(count)) / self._lam if self._lam else now
        return count * self.decay ** (now - last)


class StaticPolicy(CachePolicy):
    """A fixed set of pinned keys; they stay once loaded, every other key bypasses the cache."""

    name = "static"

    def __init__(self, capacity: int | None, pinned: Iterable[Hashable]) -> None:
        super().__init__(capacity)
        self.pinned = frozenset(pinned)
        if self.capacity is not None and len(self.pinned) > self.capacity:
            raise InvalidInput(f"{len(self.pinned)} pinned experts do not fit a capacity of {self.capacity}",
                               field="pinned", value=len(self.pinned))
        self._resident: set[Hashable] = set()

    def touch(self, key: Hashable, now: float) -> bool:
        return key in self._resident

    def admits(self, key: Hashable) -> bool:
        return key in self.pinned

    def insert(self, key: Hashable, now: float) -> Hashable | None:
        if key not in self.pinned:
            raise InvalidInput("static cache: only pinned experts may be inserted", field="key", value=key)
        self._resident.add(key)
        return None

    def remove(self, key: Hashable) -> None:
        self._resident.remove(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)


def next_use(seq: Sequence[Hashable]) -> list[int]:
    """For each position i, the next position j > i with ``seq[j] == seq[i]``; ``len(seq) + i`` if none.

    The "never again" value is distinct per position so that no two residents ever tie.
    """
    n = len(seq)
    out = [0] * n
    seen: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        key = seq[i]
        out[i] = seen.get(key, n + i)
        seen[key] = i
    return out


class BeladyPolicy(CachePolicy):
    """Offline optimum on a known access sequence (MIN with bypass); for simulation only.

    ``touch`` must be called with exactly the keys of ``future``, in order.
    """

    name = "belady"

    def __init__(self, capacity: int | None, future: Sequence[Hashable],
                 next_positions: Sequence[int] | None = None) -> None:
        super().__init__(capacity)
        self._future = future
        self._next = list(next_positions) if next_positions is not None else next_use(future)
        if len(self._next) != len(future):
            raise InvalidInput("belady: next_positions and future differ in length", field="future")
        self._pos = -1
        self._resident: dict[Hashable, int] = {}  # key -> position of its next use
        self._heap: list[tuple[int, Hashable]] = []  # (-next use, key); next uses are unique

    def touch(self, key: Hashable, now: float) -> bool:
        self._pos += 1
        pos = self._pos
        if pos >= len(self._future) or self._future[pos] != key:
            raise InvalidInput("belady: access does not follow the future sequence given to the cache",
                               field="key", value=key, offset=pos)
        if key in self._resident:
            nxt = self._next[pos]
            self._resident[key] = nxt
            heapq.heappush(self._heap, (-nxt, key))
            if len(self._heap) > 2 * len(self._resident) + 64:
                self._heap = [(-n, k) for k, n in self._resident.items()]
                heapq.heapify(self._heap)
            return True
        return False

    def _farthest(self) -> tuple[int, Hashable]:
        heap, resident = self._heap, self._resident
        while True:
            neg, key = heap[0]
            if resident.get(key) == -neg:
                return -neg, key
            heapq.heappop(heap)

    def admits(self, key: Hashable) -> bool:
        if not self._full():
            return True
        farthest, _ = self._farthest()
        return self._next[self._pos] < farthest

    def insert(self, key: Hashable, now: float) -> Hashable | None:
        victim = None
        if self._full():
            _, victim = self._farthest()
            heapq.heappop(self._heap)
            del self._resident[victim]
        nxt = self._next[self._pos]
        self._resident[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))
        return victim

    def remove(self, key: Hashable) -> None:
        del self._resident[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)


class RandomPolicy(CachePolicy):
    """Evict a uniformly random resident key (seeded, reproducible)."""

    name = "random"

    def __init__(self, capacity: int | None, seed: int = 0) -> None:
        super().__init__(capacity)
        self._rng = random.Random(seed)
        self._keys: list[Hashable] = []
        self._index: dict[Hashable, int] = {}

    def touch(self, key: Hashable, now: float) -> bool:
        return key in self._index

    def insert(self, key: Hashable, now: float) -> Hashable | None:
        if self._full():
            victim = self._keys[self._rng.randrange(len(self._keys))]
            i = self._index.pop(victim)
            self._keys[i] = key
            self._index[key] = i
            return victim
        self._index[key] = len(self._keys)
        self._keys.append(key)
        return None

    def remove(self, key: Hashable) -> None:
        i = self._index.pop(key)
        last = self._keys.pop()
        if i < len(self._keys):
            self._keys[i] = last
            self._index[last] = i

    def __contains__(self, key: Hashable) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)


def make_policy(policy: str, capacity: int | None, *, decay: float = 0.999,
                pinned: Iterable[Hashable] | None = None, future: Sequence[Hashable] | None = None,
                seed: int = 0, history: bool = False, admission: str = "always") -> CachePolicy:
    """Build one policy instance by name; ``pinned`` is for ``static``, ``future`` for ``belady``,
    ``history`` (counts survive eviction) and ``admission`` for ``lfu`` and ``lrfu``."""
    _check_choice(policy, POLICIES, "policy")
    if history and policy not in ("lfu", "lrfu"):
        raise InvalidInput("history applies to the lfu and lrfu policies only", field="history")
    if _check_choice(admission, ADMISSIONS, "admission") != "always" and policy not in ("lfu", "lrfu"):
        raise InvalidInput(f"admission={admission!r} applies to the lfu and lrfu policies only",
                           field="admission", value=admission)
    if pinned is not None and policy != "static":
        raise InvalidInput("pinned experts are only used by the static policy", field="pinned")
    if policy == "lru":
        return LRUPolicy(capacity)
    if policy == "lfu":
        return LFUPolicy(capacity, history, admission)
    if policy == "lrfu":
        return LRFUPolicy(capacity, decay, history, admission)
    if policy == "static":
        if pinned is None:
            raise InvalidInput("the static policy needs a set of pinned experts", field="pinned")
        return StaticPolicy(capacity, pinned)
    if policy == "belady":
        if future is None:
            raise InvalidInput("the belady policy needs the future access sequence (simulation only)",
                               field="future")
        return BeladyPolicy(capacity, future)
    return RandomPolicy(capacity, seed)


# --- the cache the engines use --------------------------------------------------------------------
@dataclass(frozen=True)
class CacheStats:
    """Counters since construction or the last ``reset_stats()``."""

    hits: int
    misses: int
    evictions: int
    bytes_paged: int
    hit_rate: float

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0


class _Partition:
    """One eviction domain: a policy, the values and a slot per resident key."""

    __slots__ = ("policy", "values", "slots", "free", "next_slot")

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self.values: dict[Hashable, Any] = {}
        self.slots: dict[Hashable, int] = {}
        self.free: list[int] = []
        self.next_slot = 0

    def new_slot(self) -> int:
        if self.free:
            return self.free.pop()
        slot = self.next_slot
        self.next_slot += 1
        return slot


EvictHook = Callable[[int, int, int, Any], None]  # (layer, expert, slot, value)


class ExpertCache(Generic[T]):
    """Expert cache with a fixed pool of slots, shared by the NumPy and CUDA engines.

    Args:
        capacity: experts held at once (per layer when ``scope="per_layer"``); None = unbounded.
        policy: one of ``lru``, ``lfu``, ``lrfu``, ``static``, ``belady``, ``random``.
        scope: ``global`` (one pool for all layers) or ``per_layer`` (one pool of ``capacity`` per layer).
        decay: LRFU decay factor in (0, 1], applied per clock tick.
        clock: ``access`` (the clock advances on every ``get``) or ``token`` (on every ``begin_token``).
            One clock serves every partition.
        pinned: ``(layer, expert)`` pairs kept by the ``static`` policy.
        future: the full ``(layer, expert)`` access sequence, for ``belady`` (simulation only).
        on_evict: called as ``on_evict(layer, expert, slot, value)`` before an evicted slot is reused.
        seed: for the ``random`` policy.
        history: ``lfu``/``lrfu`` only: an evicted expert's access count is remembered and resumes when
            it is loaded again (default False: counts restart at 1 on every insertion).
        admission: ``always``, or ``frequency`` (``lfu``/``lrfu`` with ``history``): a full cache admits a
            missing expert only when its count (decayed for ``lrfu``) beats the lowest resident's.

    Raises:
        InvalidInput: capacity < 1, an unknown policy, scope or clock, decay outside (0, 1], a static
            policy without pins or with more pins than slots, belady without ``future``.

    Slots: every resident entry has a slot id in ``[0, capacity)`` of its partition (per layer for
    ``per_layer``); the slot an eviction frees is the one the incoming entry receives. ``static``,
    ``belady`` and frequency admission may serve a miss without inserting it: ``get`` returns the loaded value and
    ``slot_of`` returns None for it, so an engine needs one scratch buffer for such experts.
    """

    def __init__(self, capacity: int | None, policy: str = "lrfu", scope: str = "global",
                 decay: float = 0.999, clock: str = "access",
                 pinned: Iterable[tuple[int, int]] | None = None, *,
                 future: Sequence[tuple[int, int]] | None = None,
                 on_evict: EvictHook | None = None, seed: int = 0, history: bool = False,
                 admission: str = "always") -> None:
        self.capacity = check_capacity(capacity)
        self.policy = _check_choice(policy, POLICIES, "policy")
        self.scope = _check_choice(scope, SCOPES, "scope")
        self.clock = _check_choice(clock, CLOCKS, "clock")
        self.decay = check_decay(decay)
        self.on_evict = on_evict
        self._seed = seed
        self.history = bool(history)
        self.admission = _check_choice(admission, ADMISSIONS, "admission")
        if admission != "always" and (policy not in ("lfu", "lrfu") or not history):
            raise InvalidInput(f"admission={admission!r} applies to the lfu and lrfu policies with history",
                               field="admission", value=admission)
        if history and policy not in ("lfu", "lrfu"):
            raise InvalidInput("history applies to the lfu and lrfu policies only", field="history")
        self._pinned = self._split(pinned, "pinned")
        self._future = self._split(future, "future")
        if policy == "static" and pinned is None:
            raise InvalidInput("the static policy needs a set of pinned experts", field="pinned")
        if policy == "belady" and future is None:
            raise InvalidInput("the belady policy needs the future access sequence (simulation only)",
                               field="future")
        if pinned is not None and policy != "static":
            raise InvalidInput("pinned experts are only used by the static policy", field="pinned")
        self._parts: dict[int | None, _Partition] = {}
        if policy == "static":  # check capacity against the pins now, not at first access
            for part in self._pinned:
                self._partition(part)
        self._accesses = 0
        self._tokens = 0
        self.reset_stats()

    def _split(self, pairs: Iterable[tuple[int, int]] | None, name: str) -> dict[int | None, list]:
        """Group ``(layer, expert)`` pairs by partition, keeping their order."""
        groups: dict[int | None, list] = {}
        if pairs is None:
            return groups
        for pair in pairs:
            try:
                layer, expert = (operator.index(v) for v in pair)
            except (TypeError, ValueError):
                raise InvalidInput(f"{name} must hold (layer, expert) integer pairs", field=name,
                                   value=pair) from None
            groups.setdefault(layer if self.scope == "per_layer" else None, []).append((layer, expert))
        return groups

    def _partition(self, layer: int) -> _Partition:
        pid = layer if self.scope == "per_layer" else None
        part = self._parts.get(pid)
        if part is None:
            pinned = self._pinned.get(pid, []) if self.policy == "static" else None
            future = self._future.get(pid, []) if self.policy == "belady" else None
            part = _Partition(make_policy(self.policy, self.capacity, decay=self.decay, pinned=pinned,
                                          future=future, seed=self._seed, history=self.history,
                                          admission=self.admission))
            self._parts[pid] = part
        return part

    # -- engine API --------------------------------------------------------------------------------
    def begin_token(self) -> None:
        """Advance the per-token clock (call once per forward pass)."""
        self._tokens += 1

    def get(self, layer: int, expert: int, loader: Callable[[], T],
            nbytes: int | Callable[[T], int] | None = None) -> T:
        """Return the resident value for ``(layer, expert)``, or load, count and (maybe) cache it.

        Args:
            loader: called with no argument on a miss; if it raises, the cache is left unchanged
                (apart from Belady's position in its future sequence).
            nbytes: bytes one load pages in: an int, or a callable taking the loaded value; None = 0.
        """
        key = (layer, expert)
        part = self._partition(layer)
        now = self._accesses if self.clock == "access" else self._tokens
        self._accesses += 1
        policy = part.policy
        if policy.touch(key, now):
            self._hits += 1
            return part.values[key]
        value = loader()
        self._misses += 1
        self._bytes += int(nbytes(value) if callable(nbytes) else (nbytes or 0))
        if policy.admits(key):
            victim = policy.insert(key, now)
            if victim is None:
                slot = part.new_slot()
            else:
                slot = part.slots.pop(victim)
                old = part.values.pop(victim)
                self._evictions += 1
                if self.on_evict is not None:
                    self.on_evict(victim[0], victim[1], slot, old)
            part.slots[key] = slot
            part.values[key] = value
        return value

    def contains(self, layer: int, expert: int) -> bool:
        """Whether ``(layer, expert)`` is resident (does not count as an access)."""
        part = self._parts.get(layer if self.scope == "per_layer" else None)
        return part is not None and (layer, expert) in part.slots

    def __contains__(self, key: tuple[int, int]) -> bool:
        return self.contains(*key)

    def slot_of(self, layer: int, expert: int) -> int | None:
        """The slot id of a resident entry (in ``[0, capacity)`` of its partition), else None."""
        part = self._parts.get(layer if self.scope == "per_layer" else None)
        return None if part is None else part.slots.get((layer, expert))

    def evict(self, layer: int, expert: int) -> bool:
        """Drop one entry now (calls ``on_evict``, counts an eviction); False if it was not resident."""
        part = self._parts.get(layer if self.scope == "per_layer" else None)
        key = (layer, expert)
        if part is None or key not in part.slots:
            return False
        part.policy.remove(key)
        slot = part.slots.pop(key)
        value = part.values.pop(key)
        part.free.append(slot)
        self._evictions += 1
        if self.on_evict is not None:
            self.on_evict(layer, expert, slot, value)
        return True

    def clear(self) -> None:
        """Evict everything (``on_evict`` is called for each entry)."""
        for part in list(self._parts.values()):
            for layer, expert in list(part.slots):
                self.evict(layer, expert)

    def __len__(self) -> int:
        return sum(len(p.slots) for p in self._parts.values())

    def stats(self) -> CacheStats:
        total = self._hits + self._misses
        return CacheStats(self._hits, self._misses, self._evictions, self._bytes,
                          self._hits / total if total else 0.0)

    def reset_stats(self) -> None:
        self._hits = self._misses = self._evictions = self._bytes = 0

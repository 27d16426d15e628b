"""How the forward pass obtains an expert: a callable `get_expert(layer, e) -> (gate_up, down)`.

The model only ever calls that callable, and only for experts the router picked (once per layer per forward
pass), so an expert never routed is never read. What sits between the model and the weights is composed here:
a cache is anything with `get(layer, expert, loader)` that returns the resident value or calls `loader()` and
may keep the result; the engines use `runtime.cache.ExpertCache`, and `DictExpertCache` is a dependency-free
LRU for unit tests.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


from colibri_format.runtime.weights import ExpertArrays, WeightProvider

ExpertSource = Callable[[int, int], ExpertArrays]


class ExpertCacheLike(Protocol):
    def get(self, layer: int, expert: int, loader: Callable[[], Any], nbytes: Any = None) -> Any: ...


class DictExpertCache:
    """Keeps loaded experts, evicting the least recently used beyond `capacity` (None: keep all)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._store: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, layer: int, expert: int, loader: Callable[[], Any], nbytes: Any = None) -> Any:
        key = (layer, expert)
        if key in self._store:
            self.hits += 1
            self._store.move_to_end(key)
            return self._store[key]
        self.misses += 1
        value = loader()
        if self.capacity != 0:
            self._store[key] = value
        if self.capacity is not None and len(self._store) > self.capacity:
            self._store.popitem(last=False)
        return value


@dataclass
class PagingStats:
    requests: int = 0          # calls from the model (one per routed expert per forward)
    loads: int = 0             # times the weights were actually read and dequantized
    bytes_paged: int = 0       # stored bytes read for those loads
    touched: set[tuple[int, int]] = field(default_factory=set)


class CachedExperts:
    """`ExpertSource` that goes through a cache and counts what it pages in."""

    def __init__(self, weights: WeightProvider, cache: ExpertCacheLike | None = None) -> None:
        self.weights = weights
        self.cache = cache if cache is not None else DictExpertCache()
        self.stats = PagingStats()
        self._last_nbytes = 0

    def __call__(self, layer: int, expert: int) -> ExpertArrays:
        self.stats.requests += 1
        self.stats.touched.add((layer, expert))
        return self.cache.get(layer, expert, lambda: self._load(layer, expert), nbytes=lambda _: self._last_nbytes)

    def _load(self, layer: int, expert: int) -> ExpertArrays:
        self._last_nbytes = self.weights.expert_nbytes(layer, expert)   # stored bytes, not the float32 copy
        self.stats.loads += 1
        self.stats.bytes_paged += self._last_nbytes
        return self.weights.expert(layer, expert)

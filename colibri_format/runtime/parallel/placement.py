"""Which rank owns which expert: a disjoint split of every MoE layer's experts across `world_size` ranks.

Without a trace each rank gets a contiguous run of expert ids. The WSIT stores a layer's experts in id order
(spec §7), so a contiguous run is one contiguous byte range of the file per layer per rank: each rank maps and
reads only its own range. With a routing trace the split is chosen per layer to even out the expected work
(token-expert pairs) while keeping the expert count of every rank within one of the others, so memory stays
balanced too. Everything here is deterministic: ties break on the lower expert id, then the lower rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from colibri_format.errors import InvalidInput


@dataclass(frozen=True)
class Placement:
    world_size: int
    num_experts: int
    owners: dict[int, tuple[int, ...]]        # MoE layer -> owning rank of each expert id
    strategy: str                              # "contiguous" | "balanced"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.owners))

    def owner(self, layer: int, expert: int) -> int:
        return self.owners[layer][expert]

    def experts_of(self, rank: int, layer: int) -> tuple[int, ...]:
        return tuple(e for e, r in enumerate(self.owners[layer]) if r == rank)

    def owned(self, rank: int) -> set[tuple[int, int]]:
        return {(layer, e) for layer in self.owners for e in self.experts_of(rank, layer)}

    def owner_array(self, layer: int) -> np.ndarray:
        return np.asarray(self.owners[layer], dtype=np.int64)

    def rank_loads(self, loads: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Expected work per rank in each layer, given the expected work per expert."""
        return {layer: np.bincount(self.owner_array(layer), weights=np.asarray(loads[layer], np.float64),
                                   minlength=self.world_size) for layer in self.moe_layers}

    def imbalance(self, loads: dict[int, np.ndarray]) -> dict[str, float]:
        """Predicted max/mean per-rank load: per layer (each layer waits for its slowest rank), then summarized."""
        ratios = [_ratio(r) for r in self.rank_loads(loads).values()]
        return {"mean_max_over_mean": float(np.mean(ratios)) if ratios else 1.0,
                "worst_layer_max_over_mean": float(np.max(ratios)) if ratios else 1.0}


def _ratio(per_rank: np.ndarray) -> float:
    mean = float(per_rank.mean())
    return float(per_rank.max()) / mean if mean > 0 else 1.0


def _check(num_experts: int, moe_layers: Sequence[int], world_size: int) -> None:
    for name, value in (("num_experts", num_experts), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInput(f"{name} must be a positive integer", field=name, value=value)
    if world_size > num_experts:
        raise InvalidInput(f"world size {world_size} exceeds the {num_experts} experts per layer: some rank "
                           "would own no expert", field="world_size", value=world_size)
    if len(set(moe_layers)) != len(moe_layers):
        raise InvalidInput("moe_layers repeats a layer", field="moe_layers", value=list(moe_layers))


def quotas(num_experts: int, world_size: int) -> list[int]:
    """Experts per rank: equal within one, the larger shares on the lower ranks."""
    base, extra = divmod(num_experts, world_size)
    return [base + (r < extra) for r in range(world_size)]


def contiguous_owners(num_experts: int, world_size: int) -> tuple[int, ...]:
    return tuple(r for r, n in enumerate(quotas(num_experts, world_size)) for _ in range(n))


def balanced_owners(load: np.ndarray, world_size: int) -> tuple[int, ...]:
    """Largest expected load first onto the least-loaded rank that still has room (counts within ±1)."""
    num_experts = len(load)
    base, extra = divmod(num_experts, world_size)
    owners = [-1] * num_experts
    rank_load = [0.0] * world_size
    count = [0] * world_size
    big_left = extra                                   # how many ranks may still take base + 1 experts
    for e in sorted(range(num_experts), key=lambda e: (-float(load[e]), e)):
        room = [r for r in range(world_size) if count[r] < base or (count[r] == base and big_left > 0)]
        r = min(room, key=lambda r: (rank_load[r], count[r], r))
        big_left -= count[r] == base
        owners[e], rank_load[r], count[r] = r, rank_load[r] + float(load[e]), count[r] + 1
    return tuple(owners)


def plan_placement(num_experts: int, moe_layers: Sequence[int], world_size: int,
                   trace=None) -> Placement:
    """Disjoint ownership of every MoE layer's experts; `trace` (a runtime.cache.trace.Trace) balances the load."""
    layers = tuple(sorted(int(x) for x in moe_layers))
    _check(num_experts, layers, world_size)
    if trace is None:
        owners = {layer: contiguous_owners(num_experts, world_size) for layer in layers}
        return Placement(world_size, num_experts, owners, "contiguous")
    loads = expert_loads(trace, num_experts, layers)
    owners = {layer: _better(loads[layer], world_size) for layer in layers}
    return Placement(world_size, num_experts, owners, "balanced")


def _better(load: np.ndarray, world_size: int) -> tuple[int, ...]:
    """The greedy split, unless it does not lower the layer's max rank load: then the file-ordered split."""
    contiguous = contiguous_owners(len(load), world_size)
    greedy = balanced_owners(load, world_size)
    peak = [np.bincount(o, weights=load, minlength=world_size).max() for o in (contiguous, greedy)]
    return greedy if peak[1] < peak[0] else contiguous


def expert_loads(trace, num_experts: int, moe_layers: Sequence[int]) -> dict[int, np.ndarray]:
    """Token-expert pairs per (layer, expert) in a trace: the work each expert's owner does."""
    from colibri_format.runtime.cache.trace import access_sequence

    header = trace.header
    if header.num_experts != num_experts or tuple(header.moe_layers) != tuple(moe_layers):
        raise InvalidInput("the routing trace was recorded for another model (experts or MoE layers differ)",
                           field="trace", value=(header.num_experts, list(header.moe_layers)))
    acc = access_sequence(trace, dedup=False)          # every token's choice is work for the owner
    return {layer: np.bincount(acc.expert[acc.layer == layer], minlength=num_experts).astype(np.float64)
            for layer in moe_layers}


def describe(placement: Placement, loads: dict[int, np.ndarray] | None = None) -> dict:
    """A JSON-able summary: experts per rank, and the predicted imbalance when loads are known."""
    out = {"strategy": placement.strategy, "world_size": placement.world_size,
           "experts_per_rank": [len(placement.experts_of(r, placement.moe_layers[0]))
                                for r in range(placement.world_size)] if placement.owners else []}
    if loads is not None:
        out["predicted"] = placement.imbalance(loads)
        contiguous = plan_placement(placement.num_experts, placement.moe_layers, placement.world_size)
        out["predicted_contiguous"] = contiguous.imbalance(loads)
    return out

"""One expert-parallel MoE step over torch.distributed: dispatch token rows to expert owners, combine back.

Every rank holds the same hidden states (dense layers are replicated) and computes the same routing, so the
whole exchange plan (who sends which (token, slot) pair where) is known everywhere without exchanging counts.
The token rows are split into contiguous "home" shares, one per rank; for one MoE layer:

1. dispatch: each home sends the rows of its (token, slot) pairs to the rank owning the chosen expert
   (`all_to_all_single`, split sizes from the plan);
2. the owner runs each owned expert over the rows it received (the only experts a rank ever loads);
3. combine: the outputs go back along the same routes (`all_to_all_single`, splits swapped) and the home sums
   them with the router weights in top-k slot order, a fixed order whatever the placement;
4. `all_gather` re-replicates the [T, H] result for the next (replicated) dense layer.

The same code runs with gloo on CPU tensors and NCCL on `cuda:rank` tensors; arithmetic is float32. The dense
layers run on the NumPy backend (replicated on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from colibri_format.runtime.forward import Decoder
from colibri_format.runtime.numpy_backend import round_int8_groups as numpy_round_int8_groups
from colibri_format.runtime.parallel.placement import Placement, quotas


class NotOwned(RuntimeError):
    """An expert another rank owns was requested here: a bug in the exchange plan, never a user error."""


class ResidentExperts:
    """Every owned expert kept on this rank's device once loaded; the others refused.

    Expert parallelism exists so that each share fits: owned experts stay resident (no eviction), stored as
    float32 torch tensors where the expert kernels run.
    """

    def __init__(self, owned: set[tuple[int, int]], device: str) -> None:
        self.owned = frozenset(owned)
        self.device = torch.device(device)
        self._store: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.hits = 0
        self.misses = 0

    def get(self, layer: int, expert: int, loader: Callable, nbytes=None):
        key = (layer, expert)
        if key not in self.owned:
            raise NotOwned(f"rank asked for expert {key}, which it does not own")
        if key in self._store:
            self.hits += 1
            return self._store[key]
        self.misses += 1
        gate_up, down = loader()
        self._store[key] = (torch.from_numpy(np.ascontiguousarray(gate_up)).to(self.device),
                            torch.from_numpy(np.ascontiguousarray(down)).to(self.device))
        return self._store[key]

    def __len__(self) -> int:
        return len(self._store)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._store

    @property
    def loaded(self) -> set[tuple[int, int]]:
        return set(self._store)


RoundInput = Callable[[torch.Tensor], torch.Tensor]


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               round_input: RoundInput | None = None) -> torch.Tensor:
    """down(silu(gate x) * up x); round_input (if given) applied to each product's input, as the single-process
    engines do with EngineConfig.int8_activations."""
    keep = round_input or (lambda t: t)
    h = keep(x) @ gate_up.T                              # [n, 2I]: gate rows first, then up (spec §8)
    inter = gate_up.shape[0] // 2
    return keep(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ down.T


def round_int8_groups(t: torch.Tensor) -> torch.Tensor:
    """The NumPy engine's int8-per-group rounding (numpy_backend.round_int8_groups) of a torch tensor, computed by
    that function itself on the host so the ranks' arithmetic is the single-process engine's bit for bit."""
    return torch.from_numpy(numpy_round_int8_groups(t.detach().cpu().numpy())).to(t.device)


@dataclass(frozen=True)
class ExchangePlan:
    """This rank's part of one layer's exchange; pair p = token * k + slot."""
    home_rows: slice              # the token rows this rank combines
    send_pairs: np.ndarray        # pairs of my home rows, grouped by owner rank (then pair order)
    send_splits: list[int]        # rows sent to each rank
    recv_pairs: np.ndarray        # pairs I compute, grouped by home rank (then pair order)
    recv_splits: list[int]        # rows received from each rank
    row_quotas: list[int]         # home rows of every rank


def make_plan(owners: np.ndarray, idx: np.ndarray, rank: int, world: int) -> ExchangePlan:
    """Deterministic from (owners, idx) alone, so every rank derives matching split sizes."""
    T, k = idx.shape
    row_quotas = quotas(T, world)                                     # a rank may have no rows (T < world)
    starts = np.cumsum([0] + row_quotas)
    home_rows = slice(int(starts[rank]), int(starts[rank + 1]))
    pair_owner = owners[idx.reshape(-1)]                              # [T*k]
    pair_home = np.repeat(np.arange(world), np.asarray(row_quotas) * k)
    mine = np.arange(home_rows.start * k, home_rows.stop * k)
    send = mine[np.argsort(pair_owner[mine], kind="stable")]
    recv = np.nonzero(pair_owner == rank)[0]                          # pair order = home order (homes contiguous)
    return ExchangePlan(home_rows, send, np.bincount(pair_owner[mine], minlength=world).tolist(),
                        recv, np.bincount(pair_home[recv], minlength=world).tolist(), row_quotas)


class ExpertExchange:
    """The routed-expert part of every MoE layer, for one rank of an expert-parallel group."""

    def __init__(self, placement: Placement, rank: int, get_expert: Callable, device: str,
                 group=None, check_routing: bool = False, round_input: RoundInput | None = None) -> None:
        self.placement, self.rank, self.world = placement, rank, placement.world_size
        self.get_expert = get_expert
        self.device = torch.device(device)
        self.group = group
        self.check_routing = check_routing
        self._owners = {layer: placement.owner_array(layer) for layer in placement.moe_layers}
        self.rows_sent = 0          # token rows this rank dispatched to other ranks (for stats)
        self.round_input = round_input   # the expert products' input rounding (int8 activations), or None

    def routed(self, layer: int, x: np.ndarray, weights: np.ndarray, idx: np.ndarray) -> np.ndarray:
        if self.check_routing:
            self._assert_same_routing(idx)
        plan = make_plan(self._owners[layer], idx, self.rank, self.world)
        k, H = idx.shape[1], x.shape[1]
        xt = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(self.device)
        received = self._all_to_all(xt[self._index(plan.send_pairs // k)], plan.recv_splits,
                                    plan.send_splits, H)
        computed = self._compute(layer, received, idx.reshape(-1)[plan.recv_pairs])
        returned = self._all_to_all(computed, plan.send_splits, plan.recv_splits, H)
        home = self._combine(plan, returned, weights, k, H)
        self.rows_sent += sum(n for r, n in enumerate(plan.send_splits) if r != self.rank)
        return self._gather(home, plan.row_quotas, H)

    def _index(self, positions: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(positions, np.int64)).to(self.device)

    def _all_to_all(self, send: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                    H: int) -> torch.Tensor:
        out = torch.empty((sum(recv_splits), H), dtype=torch.float32, device=self.device)
        dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def _compute(self, layer: int, rows: torch.Tensor, experts: np.ndarray) -> torch.Tensor:
        out = torch.empty_like(rows)
        for e in np.unique(experts):                     # ascending: each owned expert fetched once per step
            sel = self._index(np.nonzero(experts == e)[0])
            gate_up, down = self.get_expert(layer, int(e))
            out[sel] = expert_ffn(rows[sel], gate_up, down, self.round_input)
        return out

    def _combine(self, plan: ExchangePlan, returned: torch.Tensor, weights: np.ndarray, k: int,
                 H: int) -> torch.Tensor:
        rows = plan.home_rows.stop - plan.home_rows.start
        by_pair = torch.empty((rows * k, H), dtype=torch.float32, device=self.device)
        local = self._index(plan.send_pairs - plan.home_rows.start * k)
        by_pair[local] = returned
        by_pair = by_pair.view(rows, k, H)
        w = torch.from_numpy(np.ascontiguousarray(weights[plan.home_rows], np.float32)).to(self.device)
        out = torch.zeros((rows, H), dtype=torch.float32, device=self.device)
        for slot in range(k):                            # fixed slot order: same sum on any placement
            out += w[:, slot, None] * by_pair[:, slot]
        return out

    def _gather(self, home: torch.Tensor, row_quotas: list[int], H: int) -> np.ndarray:
        width = max(row_quotas)                          # all_gather needs equal shapes: pad every share
        padded = torch.zeros((width, H), dtype=torch.float32, device=self.device)
        padded[: home.shape[0]] = home
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        full = torch.cat([p[:n] for p, n in zip(parts, row_quotas)])
        return full.cpu().numpy()

    def _assert_same_routing(self, idx: np.ndarray) -> None:
        """Debug check: the plan is only consistent if every rank routed identically."""
        digest = torch.tensor([float(np.sum(idx.reshape(-1) * (np.arange(idx.size) % 9973 + 1)))],
                              dtype=torch.float64, device=self.device)
        lo, hi = digest.clone(), digest.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        if lo.item() != hi.item():
            raise RuntimeError("ranks disagree on the routing: hidden states diverged")


class ExpertParallelDecoder(Decoder):
    """The decoder with its routed-expert sum replaced by the cross-rank exchange (NumPy backend)."""

    def __init__(self, args, dense, experts, be, exchange: ExpertExchange) -> None:
        super().__init__(args, dense, experts, be)
        self.exchange = exchange

    def routed(self, i: int, x, ids, weights, h, ws) -> None:
        y = self.exchange.routed(i, x, weights, ids.astype(np.int64))
        h += h.dtype.type(self.a.residual_mult) * y

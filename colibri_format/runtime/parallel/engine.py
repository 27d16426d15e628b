"""`ExpertParallelEngine`: the `Engine`'s API (NumPy backend), one instance per rank, all ranks in lockstep.

Every rank opens the same file, keeps the dense tensors (replicated) and only its own experts, and must be
given the same calls with the same arguments (the launcher runs the same command line on every rank). Routing
and sampling are computed identically on every rank; the one thing a rank cannot know by itself, whether a
user callback on rank 0 asked to stop, is broadcast from rank 0 after every token.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from colibri_format.errors import InvalidInput, UnsupportedModel
from colibri_format.runtime.cuda.limits import rounds_activations
from colibri_format.runtime.engine import Engine, EngineConfig, GenerationResult
from colibri_format.runtime.parallel.ep import ExpertExchange, ExpertParallelDecoder, ResidentExperts, round_int8_groups
from colibri_format.runtime.parallel.placement import Placement, plan_placement


class ExpertParallelEngine(Engine):
    """One rank of an expert-parallel group (torch.distributed must already be initialized)."""

    def __init__(self, source: str | os.PathLike, config: EngineConfig | None = None, *,
                 device: str = "cpu", placement: Placement | None = None, trace=None, group=None,
                 check_routing: bool = False) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidInput("expert parallelism needs an initialized torch.distributed group "
                               "(start the ranks with `colibri infer --devices` or parallel.launch)",
                               field="devices")
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        config = config or EngineConfig()
        if config.max_cached_experts is not None:
            raise InvalidInput("with expert parallelism each rank keeps its whole share of experts resident: "
                               "drop max_cached_experts", field="max_cached_experts",
                               value=config.max_cached_experts)
        # Only rank 0 writes the routing trace: every rank routes the same tokens.
        super().__init__(source, replace(config, device="cpu",
                                         trace_path=config.trace_path if self.rank == 0 else None))
        if self.args.expert_act is not None or self.args.expert_bias:
            self.close()
            raise UnsupportedModel("expert parallelism computes silu(gate) * up experts without biases; this "
                                   "model's experts have biases or the clamped SwiGLU (gpt-oss): run it in one "
                                   "process", field="devices")
        self.group = group
        self.placement = placement or self._plan(trace)
        self.owned_store = ResidentExperts(self.placement.owned(self.rank), device)
        rounds = rounds_activations(config.int8_activations, self.experts.layout.expert_format)
        self.exchange = ExpertExchange(self.placement, self.rank, self._owned_expert, device, group, check_routing,
                                       round_input=round_int8_groups if rounds else None)
        self.decoder = ExpertParallelDecoder(self.args, self.dense, self.experts, self.be, self.exchange)

    def _owned_expert(self, layer: int, expert: int):
        """An owned expert's weights, counted in the pool's paging counters like any other expert access."""
        c, key = self.experts.counters, (layer, expert)
        c.touched.add(key)
        if key in self.owned_store:
            c.hits += 1
        else:
            c.misses += 1
            c.loads += 1
            c.bytes_paged += self.experts.blob_size
        return self.owned_store.get(layer, expert, lambda: self.reader.expert_f32(layer, expert))

    def _plan(self, trace) -> Placement:
        m = self.reader.model
        if not m.get("moe_layers"):
            raise InvalidInput("this file has no MoE layer to spread across ranks", field="devices")
        if isinstance(trace, (str, os.PathLike)):
            from colibri_format.runtime.cache.trace import read_trace
            trace = read_trace(trace)
        placement = plan_placement(m["num_experts"], m["moe_layers"], self.world_size, trace)
        return placement

    def preload(self) -> int:
        """Load every owned expert now (instead of on first use); returns how many this rank holds."""
        for layer, expert in sorted(self.placement.owned(self.rank)):
            self._owned_expert(layer, expert)
        return len(self.owned_store)

    # --- lockstep ----------------------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int] | str, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_ids: Sequence[int] | None = None,
                 callback: Callable[[int], Any] | None = None) -> GenerationResult:
        return super().generate(prompt_ids, max_new_tokens, temperature, top_p, seed, stop_ids,
                                self._lockstep(callback))

    def _lockstep(self, callback: Callable[[int], Any] | None) -> Callable[[int], bool]:
        """Runs on every rank after every token: rank 0's callback decides, everyone learns the decision."""
        def step(token: int) -> bool:
            halted = self.rank == 0 and callback is not None and callback(token) is False
            flag = torch.tensor([token, int(halted)], dtype=torch.int64, device=self.exchange.device)
            dist.broadcast(flag, src=0, group=self.group)
            if int(flag[0]) != token:
                raise RuntimeError(f"rank {self.rank} sampled {token}, rank 0 sampled {int(flag[0])}")
            return not bool(flag[1])
        return step

    # --- per-rank accounting -----------------------------------------------------------------------------

    @property
    def owned_experts(self) -> set[tuple[int, int]]:
        return set(self.placement.owned(self.rank))

    @property
    def touched_experts(self) -> set[tuple[int, int]]:
        """Experts this rank has loaded from the file so far (always a subset of `owned_experts`)."""
        return set(self.owned_store.loaded)


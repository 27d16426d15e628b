"""Trace-driven expert-cache simulator: replay a routing trace under every policy and capacity.

The replay uses the policy classes of :mod:`colibri_format.runtime.cache.expert_cache` (the same code as the
engines' :class:`ExpertCache`) on integer keys ``moe_layer_index * num_experts + expert``, and the same
clock values: the access clock is the position in the global access sequence (one clock for all
partitions), the token clock the forward-pass index + 1 (an engine calls ``begin_token()`` at the start
of every forward pass). Replaying a trace through an ``ExpertCache`` that way gives identical misses.

Publication lag (``lag``): the paged engine runs its cache one pass behind and publishes an admitted expert's
slot only later, so an admitted key is not a hit at once. Lag ``L`` (an integer >= 0) makes a key admitted by an
access at pass ``t`` a hit from pass ``t + 1 + L`` on (lag 0: today's replay, a hit from the next access on);
``fill`` is the engine's fill-on-read rule: armed from pass ``t + 2``, filled by the first pass ``p >= t + 2``
that routes it (still a miss), a hit from ``p + 2`` on. The policy sees the same accesses whatever the lag (the
engine's cache counts an admitted, unpublished expert as held), so only the hits move.

CLI::

    colibri cache-sim TRACE --capacity 10%,25%,40%,60% [--policy all] [--scope global|per_layer] [--json]
        [--admission always|frequency] [--lag 0,1,2,3,fill] [--warmup PASSES]

maps to ``run_cache_sim(TRACE, "10%,25%,40%,60%", policy="all", scope="global")``; the CLI draws the
result as a table (``colibri_format.cli.render.cache_sim_table``) or prints it as JSON.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_format.errors import InvalidInput
from colibri_format.runtime.cache.expert_cache import (ADMISSIONS, SCOPES, BeladyPolicy, CachePolicy, check_decay,
                                                       make_policy, next_use)
from colibri_format.runtime.cache.trace import (Accesses, Trace, access_sequence, check_shape, make_header,
                                                read_accesses, records_from_arrays)


@dataclass(frozen=True)
class PolicySpec:
    """One simulated configuration: a policy name plus LRFU's decay and clock, and whether LFU/LRFU
    counts survive eviction (``history``)."""

    policy: str
    decay: float = 0.999
    clock: str = "access"
    history: bool = False

    @property
    def label(self) -> str:
        """Human label, e.g. ``lrfu+hist d=0.999/token``."""
        name = self.policy + ("+hist" if self.history else "")
        if self.policy == "lrfu":
            return f"{name} d={self.decay:g}/{self.clock}"
        return name

    @property
    def text(self) -> str:
        """The form :func:`parse_policies` reads back, e.g. ``lrfu+hist:0.999:token``."""
        name = self.policy + ("+hist" if self.history else "")
        return f"{name}:{self.decay!r}:{self.clock}" if self.policy == "lrfu" else name


DEFAULT_POLICIES = (
    PolicySpec("lru"), PolicySpec("lfu"), PolicySpec("lfu", history=True), PolicySpec("random"),
    PolicySpec("static"),
    PolicySpec("lrfu", 0.999, "access"), PolicySpec("lrfu", 0.99, "access"),
    PolicySpec("lrfu", 0.999, "token"), PolicySpec("lrfu", 0.9, "token"),
    PolicySpec("lrfu", 0.999, "access", True), PolicySpec("lrfu", 0.9, "token", True),
    PolicySpec("belady"),
)


def parse_policies(policy: str) -> list[PolicySpec]:
    """``all`` or a comma list of ``lru``, ``lfu``, ``lfu+hist``, ``random``, ``static``, ``belady``,
    ``lrfu[+hist][:DECAY[:access|token]]`` (e.g. ``lrfu:0.99:token``). ``+hist``: counts survive
    eviction."""
    if not isinstance(policy, str) or not policy.strip():
        raise InvalidInput("empty policy list", field="policy", value=policy)
    if policy.strip() == "all":
        return list(DEFAULT_POLICIES)
    specs = []
    for item in policy.split(","):
        parts = item.strip().split(":")
        name = parts[0]
        history = name.endswith("+hist")
        if history:
            name = name[: -len("+hist")]
            if name not in ("lfu", "lrfu"):
                raise InvalidInput(f"+hist applies to lfu and lrfu only, not {item.strip()!r}", field="policy",
                                   value=item)
        if name == "lrfu" and len(parts) <= 3:
            try:
                decay = check_decay(float(parts[1])) if len(parts) > 1 else 0.999
            except ValueError:
                raise InvalidInput(f"bad LRFU decay in {item!r}", field="policy", value=item) from None
            clock = parts[2] if len(parts) > 2 else "access"
            if clock not in ("access", "token"):
                raise InvalidInput(f"unknown clock in {item!r}; expected access or token", field="policy",
                                   value=item)
            specs.append(PolicySpec("lrfu", decay, clock, history))
        elif name in ("lru", "lfu", "random", "static", "belady") and len(parts) == 1:
            specs.append(PolicySpec(name, history=history))
        else:
            raise InvalidInput(f"unknown policy {item.strip()!r}; expected all, lru, lfu[+hist], "
                               "lrfu[+hist][:decay[:clock]], static, belady or random", field="policy", value=item)
    return specs


def parse_capacities(spec: str, total: int) -> list[tuple[str, int]]:
    """Parse ``10%,25%,64`` into ``(label, capacity)`` pairs; percentages are of ``total`` experts.

    A percentage rounds to the nearest integer, at least 1.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidInput("empty capacity list", field="capacity", value=spec)
    out = []
    for item in spec.split(","):
        item = item.strip()
        try:
            if item.endswith("%"):
                frac = float(item[:-1]) / 100.0
                if not (0.0 < frac <= 1.0):
                    raise ValueError
                cap = max(1, int(round(frac * total)))
            else:
                cap = int(item)
                if cap < 1:
                    raise ValueError
        except ValueError:
            raise InvalidInput(f"bad capacity {item!r}: use a percentage in (0%, 100%] or a count >= 1",
                               field="capacity", value=item) from None
        out.append((item, cap))
    return out


def top_experts(keys: np.ndarray, capacity: int, parts: np.ndarray | None = None) -> list[int]:
    """The ``capacity`` most accessed keys (per partition when ``parts`` is given); ties -> smaller key."""
    groups = [keys] if parts is None else [keys[parts == p] for p in np.unique(parts)]
    pinned: list[int] = []
    for g in groups:
        uniq, counts = np.unique(g, return_counts=True)
        order = np.lexsort((uniq, -counts))  # count descending, then key ascending
        pinned.extend(uniq[order[:capacity]].tolist())
    return pinned


FILL = "fill"        # the lag of the engine's fill-on-read rule (see the module docstring)


def parse_lags(spec: str) -> list[int | str]:
    """``0,1,2,3,fill`` -> ``[0, 1, 2, 3, "fill"]`` (integers >= 0 and ``fill``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidInput("empty lag list", field="lag", value=spec)
    out: list[int | str] = []
    for item in spec.split(","):
        item = item.strip()
        if item == FILL:
            out.append(FILL)
        elif item.isdigit() and len(item) <= 6:
            out.append(int(item))
        else:
            raise InvalidInput(f"bad lag {item!r}: use an integer >= 0 or 'fill'", field="lag", value=item)
    return out


@dataclass(frozen=True)
class SimResult:
    accesses: int          # counted accesses (those of passes >= warmup)
    hits: int
    misses: int
    evictions: int
    admissions: int = 0    # counted insertions (under ``fill``: counted fills, admissions routed again)

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0


def _replay(keys: list[int], clocks: Sequence[int], parts: list[int] | None,
            policies: list[CachePolicy]) -> tuple[int, int, int]:
    """Run the access/miss/insert protocol; returns (misses, evictions, admissions)."""
    misses = evictions = admissions = 0
    if parts is None:
        pol = policies[0]
        touch, admits, insert = pol.touch, pol.admits, pol.insert
        for key, now in zip(keys, clocks):
            if touch(key, now):
                continue
            misses += 1
            if admits(key):
                admissions += 1
                if insert(key, now) is not None:
                    evictions += 1
        return misses, evictions, admissions
    bound = [(p.touch, p.admits, p.insert) for p in policies]
    for key, now, part in zip(keys, clocks, parts):
        touch, admits, insert = bound[part]
        if touch(key, now):
            continue
        misses += 1
        if admits(key):
            admissions += 1
            if insert(key, now) is not None:
                evictions += 1
    return misses, evictions, admissions


def _still_read(gone: dict[int, tuple[int, int]], key: int, step: int) -> bool:
    span = gone.get(key)
    return span is not None and span[0] <= step <= span[1]


def _replay_lagged(keys: list[int], steps: list[int], clocks: Sequence[int], parts: list[int] | None,
                   policies: list[CachePolicy], lag: int | str, warmup: int) -> tuple[int, int, int, int]:
    """The access/miss/insert protocol with publication lag (module docstring); misses and accesses counted from
    pass ``warmup`` on. Returns (counted accesses, counted misses, evictions, admissions)."""
    fill = lag == FILL
    late = 1 if lag != 0 else 0    # the pipelined engine's table write is a pass behind: an evicted key stays read
    ready: dict[int, int] = {}     # admitted key -> first pass it is a hit in (fill: once filled)
    armed: dict[int, int] = {}     # fill: admitted key, not yet filled -> first pass that can fill it
    gone: dict[int, tuple[int, int]] = {}   # evicted key -> (first, last) pass that still read its old slot
    accesses = misses = evictions = admissions = 0
    for i, (key, step, now) in enumerate(zip(keys, steps, clocks)):
        pol = policies[0 if parts is None else parts[i]]
        counted = step >= warmup
        accesses += counted
        if pol.touch(key, now):
            first = ready.get(key)
            if first is None:
                start = armed.get(key)
                if start is None:              # resident from the start (static pins): never admitted
                    continue
                if step >= start:              # fill: this pass fills it, published after it is accounted
                    del armed[key]
                    ready[key] = step + 2
                    admissions += counted
            elif step >= first:
                continue
            if not _still_read(gone, key, step):
                misses += counted
            continue
        if not _still_read(gone, key, step):
            misses += counted
        if not pol.admits(key):
            continue
        victim = pol.insert(key, now)
        if victim is not None:
            evictions += 1
            first = ready.pop(victim, None)
            armed.pop(victim, None)
            if late and first is not None and first <= step + 1:
                gone[victim] = (first, step + 1)   # the tables of this pass and the next still name its slot
        if fill:
            armed[key] = step + 2              # admitted while pass step + 1 runs: armed for the pass after
        else:
            admissions += counted
            ready[key] = step + 1 + lag if lag else step
    return accesses, misses, evictions, admissions


def simulate(acc: Accesses, num_experts: int, spec: PolicySpec, capacity: int | None,
             scope: str = "global", *, layer_index: dict[int, int] | None = None, seed: int = 0,
             admission: str = "always", lag: int | str = 0, warmup: int = 0) -> SimResult:
    """Replay one access sequence under one policy and capacity (per layer for ``per_layer``).

    ``admission="frequency"`` applies to ``lfu``/``lrfu`` with history (as the engine's ``cache_admission``);
    ``lag``: publication lag (module docstring); ``warmup``: passes replayed but not counted."""
    if scope not in SCOPES:
        raise InvalidInput(f"unknown scope {scope!r}; expected global or per_layer", field="scope", value=scope)
    if layer_index is None:
        layer_index = {layer: i for i, layer in enumerate(sorted(set(acc.layer.tolist())))}
    lidx = np.zeros(max(layer_index) + 1 if layer_index else 1, dtype=np.int64)
    for layer, i in layer_index.items():
        lidx[layer] = i
    part_arr = lidx[acc.layer]
    keys_arr = part_arr * num_experts + acc.expert
    keys = keys_arr.tolist()
    n = len(keys)
    # the same clock values an ExpertCache sees when begin_token() starts every forward pass: LRFU
    # orders in floating point, so a constant offset could flip near-ties and the two would diverge
    clocks: Sequence[int] = range(n) if spec.clock == "access" else (acc.step + 1).tolist()
    if scope == "global":
        pids = [0]
        parts = None
    else:
        pids = list(range(len(layer_index)))
        parts = part_arr.tolist()

    policies: list[CachePolicy] = []
    for pid in pids:
        if spec.policy == "static":
            if scope == "global":
                pinned = top_experts(keys_arr, capacity or n)
            else:
                pinned = top_experts(keys_arr[part_arr == pid], capacity or n)
            policies.append(make_policy("static", capacity, pinned=pinned))
        elif spec.policy == "belady":
            sub = keys if parts is None else keys_arr[part_arr == pid].tolist()
            policies.append(BeladyPolicy(capacity, sub, next_use(sub)))
        else:
            policies.append(make_policy(spec.policy, capacity, decay=spec.decay, seed=seed,
                                        history=spec.history, admission=admission if spec.history else "always"))
    if lag == 0 and warmup <= 0:
        misses, evictions, admissions = _replay(keys, clocks, parts, policies)
        return SimResult(n, n - misses, misses, evictions, admissions)
    counted, misses, evictions, admissions = _replay_lagged(keys, acc.step.tolist(), clocks, parts, policies, lag,
                                                            warmup)
    return SimResult(counted, counted - misses, misses, evictions, admissions)


def _accesses_of(trace: str | os.PathLike[str] | Trace, dedup: bool) -> tuple[Any, Accesses, int]:
    """(header, global accesses, tokens) of an in-memory trace, or of a trace file streamed line by line."""
    if isinstance(trace, Trace):
        acc = access_sequence(trace, "global", dedup=dedup)
        assert isinstance(acc, Accesses)
        return trace.header, acc, len(trace.records)
    return read_accesses(trace, dedup=dedup)


def run_cache_sim(trace: str | os.PathLike[str] | Trace, capacities: str, policy: str = "all",
                  scope: str = "global", *, blob_bytes: int | None = None, dedup: bool = True,
                  seed: int = 0, admission: str = "always", lag: str = "0", warmup: int = 0) -> dict[str, Any]:
    """Replay a trace under each policy at each capacity.

    Args:
        trace: a trace path (streamed line by line: :func:`read_accesses`) or an in-memory :class:`Trace`.
        capacities: comma list of percentages of all experts (``10%,25%``; of one layer's experts for
            ``per_layer``) or absolute counts (total for ``global``, per layer for ``per_layer``).
        policy: ``all`` or a comma list (see :func:`parse_policies`).
        scope: ``global`` or ``per_layer``.
        blob_bytes: bytes of one expert blob; adds ``bytes_paged = misses * blob_bytes`` to each row.
        dedup: one access per expert per layer per forward pass (as the engines do).
        admission: ``always``, or ``frequency`` for the ``lfu``/``lrfu`` policies with history (``+hist``; the
            others admit always), as the engine's ``cache_admission``.
        lag: comma list of publication lags, integers >= 0 and ``fill`` (module docstring); one row each.
        warmup: forward passes replayed before the counting starts (the cache fills during them).

    Returns:
        ``{"trace": {...}, "scope", "dedup", "rows": [{"policy", "label", "history", "decay", "clock",
        "capacity", "capacity_spec", "fraction", "admission", "lag", "accesses", "hits", "misses", "evictions",
        "admissions", "miss_rate", "hit_rate", "bytes_paged"?}, ...]}``; a row's ``label`` names its admission
        (``freq``) and lag (``lag 2``, ``lag fill``) when they are not the defaults.
    """
    if scope not in SCOPES:
        raise InvalidInput(f"unknown scope {scope!r}; expected global or per_layer", field="scope", value=scope)
    if blob_bytes is not None and (isinstance(blob_bytes, bool) or not isinstance(blob_bytes, int)
                                   or blob_bytes < 0):
        raise InvalidInput("blob_bytes must be a non-negative integer", field="blob_bytes", value=blob_bytes)
    if admission not in ADMISSIONS:
        raise InvalidInput(f"unknown admission {admission!r}; expected always or frequency", field="admission",
                           value=admission)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InvalidInput("warmup must be a non-negative integer", field="warmup", value=warmup)
    specs = parse_policies(policy)
    lags = parse_lags(lag)
    h, acc, tokens = _accesses_of(trace, dedup)
    per_part = h.num_experts if scope == "per_layer" else h.total_experts
    caps = parse_capacities(capacities, per_part)
    layer_index = {layer: i for i, layer in enumerate(h.moe_layers)}
    distinct = len(set(zip(acc.layer.tolist(), acc.expert.tolist())))
    rows = []
    for spec, lag_one in ((spec, lag_one) for spec in specs for lag_one in lags):
        admits = admission if spec.history else "always"
        label = spec.label + (" freq" if admits != "always" else "") + (f" lag {lag_one}" if lag_one != 0 else "")
        for cap_spec, cap in caps:
            res = simulate(acc, h.num_experts, spec, cap, scope, layer_index=layer_index, seed=seed,
                           admission=admits, lag=lag_one, warmup=warmup)
            row: dict[str, Any] = {
                "policy": spec.policy, "label": label, "history": spec.history,
                "decay": spec.decay if spec.policy == "lrfu" else None,
                "clock": spec.clock if spec.policy == "lrfu" else None,
                "capacity": cap, "capacity_spec": cap_spec, "fraction": cap / per_part,
                "admission": admits, "lag": lag_one,
                "accesses": res.accesses, "hits": res.hits, "misses": res.misses,
                "evictions": res.evictions, "admissions": res.admissions, "miss_rate": res.miss_rate,
                "hit_rate": 1.0 - res.miss_rate if res.accesses else 0.0}
            if blob_bytes is not None:
                row["bytes_paged"] = res.misses * blob_bytes
            rows.append(row)
    return {
        "trace": {"model": h.model, "num_layers": h.num_layers, "moe_layers": len(h.moe_layers),
                  "num_experts": h.num_experts, "top_k": h.top_k, "tokens": tokens,
                  "steps": int(acc.step[-1]) + 1 if len(acc) else 0, "accesses": len(acc),
                  "distinct_experts": distinct,
                  "cold_miss_rate": distinct / len(acc) if len(acc) else 0.0},
        "scope": scope, "dedup": dedup, "warmup": warmup, "rows": rows}


# --- synthetic traces -----------------------------------------------------------------------------
def synthetic_trace(num_layers: int, num_experts: int, top_k: int, tokens: int, skew: float = 1.0,
                    locality: float = 0.0, seed: int = 0, *, batch: int = 1, phase: int = 0,
                    model: str = "synthetic") -> Trace:
    """A synthetic routing trace (every layer MoE) for tests and benchmarks.

    Each layer ranks its experts by a random permutation and gives rank r the popularity
    ``(r + 1) ** -skew`` (Zipf; ``skew=0`` is uniform). For each token of each sequence, every expert
    the same sequence chose at this layer on the previous step is kept with probability ``locality``;
    the remaining slots are sampled without replacement in proportion to popularity (Gumbel top-k).

    Args:
        tokens: forward passes; each routes ``batch`` tokens (one per sequence).
        phase: if > 0, every ``phase`` forward passes each layer's popularity ranking is redrawn (a
            crude model of switching to an unrelated prompt); 0 keeps it fixed (stationary).
    """
    make_header(num_layers, range(num_layers), num_experts, top_k, model)  # range checks
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidInput("tokens must be a non-negative integer", field="tokens", value=tokens)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidInput("batch must be a positive integer", field="batch", value=batch)
    if not (skew >= 0.0 and math.isfinite(skew)):
        raise InvalidInput("skew must be a finite number >= 0", field="skew", value=skew)
    if not (0.0 <= locality <= 1.0):
        raise InvalidInput("locality must be in [0, 1]", field="locality", value=locality)
    if isinstance(phase, bool) or not isinstance(phase, int) or phase < 0:
        raise InvalidInput("phase must be a non-negative integer", field="phase", value=phase)
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((num_layers, num_experts)), axis=1)  # [L, E] rank of each expert
    logp = -skew * np.log1p(ranks.astype(np.float64))                  # [L, E]
    choices = np.empty((tokens, batch, num_layers, top_k), dtype=np.int32)
    prev = np.zeros((batch, num_layers, num_experts), dtype=bool)
    rows = np.arange(batch)[:, None, None]
    cols = np.arange(num_layers)[None, :, None]
    for t in range(tokens):
        if phase and t and t % phase == 0:
            ranks = np.argsort(rng.random((num_layers, num_experts)), axis=1)
            logp = -skew * np.log1p(ranks.astype(np.float64))
        scores = logp[None] + rng.gumbel(size=(batch, num_layers, num_experts))    # [B, L, E]
        if locality > 0.0 and t > 0:
            keep = prev & (rng.random((batch, num_layers, num_experts)) < locality)
            scores[keep] = np.inf
        top = np.argpartition(-scores, top_k - 1, axis=2)[:, :, :top_k]              # [B, L, k]
        order = np.argsort(-scores[rows, cols, top], axis=2, kind="stable")         # router order
        top = np.take_along_axis(top, order, axis=2)
        choices[t] = top
        prev[:] = False
        prev[rows, cols, top] = True
    header = make_header(num_layers, range(num_layers), num_experts, top_k, model)
    return Trace(header, records_from_arrays(choices, header.moe_layers))


# --- static pins for the engines --------------------------------------------------------------------
def pins_from_trace(trace: str | os.PathLike[str] | Trace, capacity: int,
                    scope: str = "global", model: dict[str, Any] | None = None) -> list[tuple[int, int]]:
    """The experts a `static` cache should pin: the `capacity` most used of a recorded trace
    (per layer under ``per_layer``), ties broken by (layer, expert) for determinism. With `model` (the
    file's model object) a trace of another model's shape is refused (InvalidInput)."""
    capacity = int(capacity)
    if capacity < 1:
        raise InvalidInput("capacity must be a positive integer", field="capacity", value=capacity)
    header, acc, _ = _accesses_of(trace, True)
    if model is not None:
        check_shape(header, model, "pin_from_trace")
    counts: dict[tuple[int, int], int] = {}
    for pair in acc.pairs():
        counts[pair] = counts.get(pair, 0) + 1
    ranked = sorted(counts, key=lambda p: (-counts[p], p))
    if scope == "global":
        return ranked[:capacity]
    pins: list[tuple[int, int]] = []
    for layer in header.moe_layers:
        pins += [p for p in ranked if p[0] == layer][:capacity]
    return pins

"""Where each MoE layer's experts are: a fixed pool of blob-sized slots in a backend's memory, filled once
(all resident) or paged from the file on demand. The pool answers residency only; the decoder computes.

Resident: every blob is placed once at start, layer by layer (one copy per layer: a layer's blobs are contiguous
in the file; a backend whose device is host memory points straight into the file mapping instead). The tables
never change and routing never leaves the device, so a CUDA decode step can be captured in a graph.

Paged (`max_cached_experts` below the total): the router's choices reach the host once per MoE layer;
`runtime.cache.expert_cache.ExpertCache` decides residency and its slot ids index the pool, so every backend
evicts alike. A miss is one copy of the whole blob from the file mapping into its slot, on a copy stream separate
from compute. On CUDA the mapping is pinned in place with `cudaHostRegister(..., ReadOnly)` (~55 GB/s on the
H200, against ~43 GB/s for a pinned staging ring, which also costs a host memcpy per miss); if registration
fails, copies go through a double-buffered pinned staging ring. With verification on, a blob is hashed on the
host by the reader before its first copy, so a corrupt expert never reaches a kernel.

When a layer needs more distinct experts than the pool holds, its experts run in several passes: each pass
points the experts of other passes at an all-zero blob (which contributes exactly zero) and accumulates into
the residual. Ordering between the streams uses events: a copy into a slot waits for the last pass that read
the slot; a pass waits for the copies before it.

Prefetch (optional): the decoder applies the next MoE layer's router to the current layer's normalised hidden
state; its predicted experts that are not resident are paged in while the current layer computes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from colibri_format.errors import InvalidInput

MEMORY_RESERVE = 2 << 30      # bytes of device memory left for activations, KV cache, cuBLAS workspace
STAGING_BUFFERS = 2


@dataclass
class PagingCounters:
    """Demand accesses (one per routed expert per layer per forward pass) and what paging moved."""
    hits: int = 0
    misses: int = 0
    loads: int = 0                # blob copies (demand + prefetch)
    prefetch_loads: int = 0
    prefetch_hits: int = 0        # demand accesses served by a prefetched blob
    predicted: int = 0            # experts the prefetch router predicted (distinct per layer)
    predicted_correct: int = 0    # of the next layer's actually routed experts, how many were predicted
    actual_next: int = 0          # the next layer's routed experts (distinct), for recall
    bytes_paged: int = 0
    copy_seconds: float = 0.0     # host time spent issuing copies (staging memcpy included)
    stall_seconds: float = 0.0    # compute idle, waiting for copies (measured on the host)
    passes: int = 0
    tokens: int = 0
    touched: set = field(default_factory=set)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["touched"] = len(self.touched)
        acc = self.hits + self.misses
        d["hit_rate"] = self.hits / acc if acc else 0.0
        d["misses_per_token"] = self.misses / self.tokens if self.tokens else 0.0
        d["stall_ms_per_token"] = 1e3 * self.stall_seconds / self.tokens if self.tokens else 0.0
        d["prefetch_recall"] = self.predicted_correct / self.actual_next if self.actual_next else 0.0
        return d


def pool_plan(capacity: int | None, scope: str, num_layers: int, num_experts: int) -> tuple[bool, int]:
    """(resident, device slots) for a cache capacity."""
    total = num_layers * num_experts
    if capacity is None:
        return True, total
    per_layer = scope == "per_layer"
    if (per_layer and capacity >= num_experts) or (not per_layer and capacity >= total):
        return True, total
    return False, capacity * num_layers if per_layer else capacity


def check_budget(slots: int, blob_size: int, free: int, scope: str, num_layers: int, resident: bool) -> None:
    """A pool that cannot fit is refused with the largest max_cached_experts that would."""
    need = (slots + 2) * blob_size          # + the zero blob and one scratch slot
    usable = free - MEMORY_RESERVE
    if need <= usable:
        return
    fit = max(0, usable // blob_size - 2)
    largest = fit // num_layers if scope == "per_layer" else fit
    what = "all experts" if resident else f"{slots} expert slots"
    raise InvalidInput(f"{what} need {need / 2**30:.2f} GiB of device memory but {max(usable, 0) / 2**30:.2f} GiB "
                       f"is free (after a {MEMORY_RESERVE >> 30} GiB reserve); the largest max_cached_experts that "
                       f"fits is {largest}" + (" (per layer)" if scope == "per_layer" else ""),
                       field="max_cached_experts", value=largest)


class HostSource:
    """Where blob bytes come from: the registered mapping, or a pinned staging ring when registration fails."""

    def __init__(self, reader, be, base_addr: int, size: int) -> None:
        self.reader, self.be = reader, be
        self.base, self.size = base_addr, size
        self.registered = False
        self.reason = ""
        try:
            be.register_host(base_addr, size)
            self.registered = True
            self.mode = "registered"
        except Exception as exc:  # noqa: BLE001 -- any failure: use the staging ring instead
            self.mode = "staging"
            self.reason = f"cudaHostRegister of the file mapping failed ({exc}); using a pinned staging ring"
        self._staging: list = []
        self._staging_events: list = [None] * STAGING_BUFFERS
        self._next = 0

    def blob_addr(self, layer: int, expert: int) -> int:
        """Host address of a blob; the reader verifies it on first use (per its policy) before we copy."""
        view = self.reader.expert_blob(layer, expert)
        return int(np.frombuffer(view, np.uint8).ctypes.data)

    def copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        if self.registered:
            self.be.copy_htod(dst, src, nbytes, stream)
            return
        if not self._staging:
            self._staging = [self.be.pinned_empty(nbytes) for _ in range(STAGING_BUFFERS)]
        i = self._next
        self._next = (i + 1) % STAGING_BUFFERS
        if self._staging_events[i] is not None:
            self.be.sync_event(self._staging_events[i])     # the buffer's previous copy has left it
        buf = self._staging[i]
        buf[:nbytes] = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(src))
        self.be.copy_htod(dst, int(buf.ctypes.data), nbytes, stream)
        self._staging_events[i] = self.be.record(stream)

    def close(self) -> None:
        if self.registered:
            self.registered = False
            try:
                self.be.unregister_host(self.base)
            except Exception:  # noqa: BLE001 -- closing: nothing useful to do
                pass


class ExpertPool:
    def __init__(self, reader, args, config, be, compute_stream, cache_factory, prefetch: bool = False) -> None:
        self.reader, self.a, self.be = reader, args, be
        layout = reader.blob_layout
        self.layout, self.blob_size = layout, int(layout.size)
        self.layers = sorted(args.moe_layers)
        self.E = int(reader.tables.plan.num_experts)
        self.scope = config.cache_scope
        self.capacity = config.max_cached_experts
        self.resident, self.slots = pool_plan(self.capacity, self.scope, len(self.layers), self.E)
        check_budget(self.slots, self.blob_size, be.free_memory(), self.scope, len(self.layers), self.resident)
        self.compute = compute_stream
        self.copy_stream = be.new_stream()
        in_place = self.resident and be.host_is_device     # point into the file mapping: nothing to copy
        self.pool = be.empty(0 if in_place else (self.slots + 1) * self.blob_size, np.uint8)   # + a scratch slot
        self.base = be.ptr(self.pool)
        self.zero = be.zeros(self.blob_size, np.uint8)
        self.zero_ptr = be.ptr(self.zero)
        self.source = HostSource(reader, be, *self._mapping(reader))
        self.counters = PagingCounters()
        self.prefetch = bool(prefetch) and not self.resident
        self.scratch_index = self.slots
        self._slot_busy: dict[int, object] = {}
        self._last_copy = None
        self._copy_pending = False
        self._prefetched: set = set()
        self._predicted: dict[int, set] = {}
        self.resident_tables: dict[int, object] = {}
        self.time_copies = False          # bracket each copy with timing events (paging GB/s)
        self._copy_times: list = []
        self.cache = None
        try:
            if in_place:
                self._map_all()
            elif self.resident:
                self._load_all(config.verify)
            else:
                self.cache = cache_factory(on_evict=self._on_evict)
        except BaseException:      # e.g. a corrupt blob: never leave the file mapping registered behind us
            self.close()
            raise
        self.bytes_on_device = 0 if in_place else (self.slots + 2) * self.blob_size

    @staticmethod
    def _mapping(reader) -> tuple[int, int]:
        """(address, size) of the whole file mapping, found through a (verified) dense tensor's view of it."""
        entry = reader.tables.dense[0]
        view = reader.dense(entry.name)
        return int(view.ctypes.data) - int(entry.offset), int(reader.tables.file_size)

    # --- tables -----------------------------------------------------------------------------------------
    def table(self, ptrs):
        return self.be.expert_table(ptrs, self.layout, self.zero_ptr)

    def _slot_addr(self, index: int) -> int:
        return self.base + index * self.blob_size

    # --- resident -----------------------------------------------------------------------------------------
    def _load_all(self, verify: str) -> None:
        """One copy per layer (its blobs are contiguous in the file), after verifying each blob on the host."""
        plan = self.reader.tables.plan
        t0 = time.perf_counter()
        for li, layer in enumerate(self.layers):
            if verify != "never":
                for e in range(self.E):
                    self.reader.verify_expert(layer, e)
            src = self.source.base + plan.blob_offset(layer, 0)
            dst = self._slot_addr(li * self.E)
            if self.source.registered:
                self.be.copy_htod(dst, src, self.E * self.blob_size, self.copy_stream)
            else:
                for e in range(self.E):
                    self.source.copy(dst + e * self.blob_size, src + e * self.blob_size, self.blob_size,
                                     self.copy_stream)
            ptrs = np.array([self._slot_addr(li * self.E + e) for e in range(self.E)], np.uint64)
            self.resident_tables[layer] = self.table(self.be.to_device(ptrs))
        self.be.sync_event(self.be.record(self.copy_stream))
        self.load_seconds = time.perf_counter() - t0
        self.counters.bytes_paged += len(self.layers) * self.E * self.blob_size

    def _map_all(self) -> None:
        """Tables that point straight at the blobs in the file mapping (a backend whose device is host memory);
        each blob is checked by the reader's policy when first read, so an expert never routed is never read."""
        for layer in self.layers:
            ptrs = np.array([self.source.base + self.reader.blob_offset(layer, e) for e in range(self.E)], np.uint64)
            self.resident_tables[layer] = self.be.expert_table(
                ptrs, self.layout, self.zero_ptr, check=lambda e, layer=layer: self.reader.expert_blob(layer, e))
        self.load_seconds = 0.0

    # --- residency ------------------------------------------------------------------------------------------
    def prefetch_layer(self, layer: int) -> int | None:
        """The MoE layer whose experts to predict while `layer` computes (None: no prefetch)."""
        return self._next_layer(layer) if self.prefetch else None

    def tables(self, layer: int, ids, ws, predicted=None):
        """Yields the expert tables of `layer` for the routed `ids` [T, k]: one when resident; when paged, one per
        pass, each after the copies it needs (the caller runs the pass before asking for the next table)."""
        if self.resident:
            if self.be.host_is_device:        # the routing is on the host already: counting it costs no sync
                self.counters.touched.update((layer, int(e)) for e in np.unique(ids))
            yield self.resident_tables[layer]
            return
        ids_h = self.be.to_host(ids)                                  # the one sync of a paged layer
        uniq = np.unique(ids_h)
        self._score_prediction(layer, uniq)
        self.counters.touched.update((layer, int(e)) for e in uniq)
        members: dict[int, int] = {}
        for e in uniq:
            index = self._demand(layer, int(e))
            if index in members.values():         # this layer already uses that slot: run what we have first
                yield self._pass_table(members, ws)
                self._pass_done(members)
                members = {}
            self._fill(layer, int(e), index)
            members[int(e)] = index
        if members:
            yield self._pass_table(members, ws)
            self._pass_done(members)
        if predicted is not None:
            self._prefetch(self._next_layer(layer), np.unique(self.be.to_host(predicted)), set(members.values()))

    def _next_layer(self, layer: int) -> int | None:
        i = self.layers.index(layer)
        return self.layers[i + 1] if i + 1 < len(self.layers) else None

    def _demand(self, layer: int, e: int) -> int:
        """Pool index for a routed expert (after the cache's decision); queues nothing yet."""
        c = self.counters
        resident = self.cache.contains(layer, e)
        self._need_copy = not resident
        src = self.cache.get(layer, e, lambda: self.source.blob_addr(layer, e), nbytes=self.blob_size)
        self._src = src
        if resident:
            c.hits += 1
            if (layer, e) in self._prefetched:
                c.prefetch_hits += 1
                self._prefetched.discard((layer, e))
        else:
            c.misses += 1
        slot = self.cache.slot_of(layer, e)
        if slot is None:                          # served without admission (static policy): scratch slot
            self._need_copy = True
            return self.scratch_index
        return self._pool_index(layer, slot)

    def _pool_index(self, layer: int, slot: int) -> int:
        if self.scope == "per_layer":
            return self.layers.index(layer) * self.capacity + slot
        return slot

    def _on_evict(self, layer: int, expert: int, slot: int, value) -> None:
        self._prefetched.discard((layer, expert))

    def _fill(self, layer: int, e: int, index: int) -> None:
        if not self._need_copy:
            return
        self._copy(index, self._src)

    def _copy(self, index: int, src: int) -> None:
        busy = self._slot_busy.get(index)
        if busy is not None:
            self.be.wait(self.copy_stream, busy)           # the last pass reading this slot is done
        t0 = time.perf_counter()
        start = self.be.timing_event(self.copy_stream) if self.time_copies else None
        self.source.copy(self._slot_addr(index), src, self.blob_size, self.copy_stream)
        if start is not None:
            self._copy_times.append((start, self.be.timing_event(self.copy_stream)))
        self.counters.copy_seconds += time.perf_counter() - t0
        self._last_copy = self.be.record(self.copy_stream)
        self._copy_pending = True
        self.counters.loads += 1
        self.counters.bytes_paged += self.blob_size

    def _pass_table(self, members: dict[int, int], ws):
        """The table of one pass: its members' slots, every other expert at the zero blob."""
        if self._copy_pending:
            t0 = time.perf_counter()
            self.be.sync_event(self._last_copy)               # compute is idle here: this wait is the stall
            self.counters.stall_seconds += time.perf_counter() - t0
            self.be.wait(self.compute, self._last_copy)
            self._copy_pending = False
        ptrs = np.full(self.E, self.zero_ptr, np.uint64)
        for e, index in members.items():
            ptrs[e] = self._slot_addr(index)
        dev = ws.buf("pass_ptrs", (self.E,), np.uint64)
        self.be.set_from_host(dev, ptrs, self.compute)
        return self.table(dev)

    def _pass_done(self, members: dict[int, int]) -> None:
        done = self.be.record(self.compute)
        for index in members.values():
            self._slot_busy[index] = done
        self.counters.passes += 1

    # --- prefetch -----------------------------------------------------------------------------------------------
    def _prefetch(self, layer: int, predicted: np.ndarray, in_use: set[int]) -> None:
        """Page in the predicted experts of `layer` that are not resident (never evicting this layer's slots)."""
        self._predicted[layer] = {int(e) for e in predicted}
        self.counters.predicted += len(predicted)
        room = (self.capacity if self.scope == "per_layer" else self.slots) - len(in_use)
        missing = [int(e) for e in predicted if not self.cache.contains(layer, int(e))]
        if len(missing) > room // 2:
            missing = missing[:room // 2]          # never let a prefetch churn most of the cache
        for e in missing:
            src = self.cache.get(layer, e, lambda e=e: self.source.blob_addr(layer, e), nbytes=self.blob_size)
            slot = self.cache.slot_of(layer, e)
            if slot is None:
                continue
            self._copy(self._pool_index(layer, slot), src)
            self._prefetched.add((layer, e))
            self.counters.prefetch_loads += 1

    def _score_prediction(self, layer: int, actual: np.ndarray) -> None:
        predicted = self._predicted.pop(layer, None)
        if predicted is None:
            return
        self.counters.actual_next += len(actual)
        self.counters.predicted_correct += sum(int(e) in predicted for e in actual)

    def copy_bandwidth(self) -> tuple[float, int]:
        """(seconds the copy stream spent copying, copies) since the last call (needs time_copies)."""
        seconds = sum(self.be.elapsed_ms(a, b) for a, b in self._copy_times) / 1e3
        n = len(self._copy_times)
        self._copy_times = []
        return seconds, n

    # --- lifetime ---------------------------------------------------------------------------------------------
    def begin_token(self, rows: int) -> None:
        self.counters.tokens += rows
        if self.cache is not None:
            self.cache.begin_token()

    def close(self) -> None:
        self.be.sync_event(self.be.record(self.copy_stream))
        self.source.close()
        self.pool = self.zero = None
        self.resident_tables = {}

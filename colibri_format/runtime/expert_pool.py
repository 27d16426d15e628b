"""Where each MoE layer's experts are: a table of blob addresses per layer that the expert kernels read, filled
once (all resident) or kept up to date by a cache that runs beside the computation (paged).

Resident: every blob is placed once at start, layer by layer (one copy per layer: a layer's blobs are contiguous
in the file; a backend whose device is host memory points straight into the file mapping instead).

Paged (`max_cached_experts` or `gpu_memory` below what all experts need): the table entry of an expert is its
device slot when the cache holds it, otherwise the blob's address in the host mapping, which the kernels read
over PCIe themselves (the mapping is pinned with `cudaHostRegister`; with unified addressing the host address is
the device address). So a pass never waits for the host: the decode step stays one CUDA graph and routing
never leaves the device. The kernels count the pairs routed to each expert (`route_totals`, cumulative).

After each pass the host runs the cache off the critical path (`after_pass`):
1. it queues a copy of the route totals to pinned memory (event-ordered behind the pass);
2. it reads the previous pass's totals (complete by then: the host has read that pass's logits) and hands each
   routed expert to `runtime.cache.expert_cache.ExpertCache` (lrfu, lru, lfu, static: the simulator's code);
   an access is a hit when the table pointed at a slot during that pass, else a miss read over PCIe;
3. evictions point their entries back at the mapping at once. How an admitted expert reaches its slot is
   `expert_loading` (EngineConfig):
   - "fill" (default): it is *filled on read*: its entry in a second table (`fill_ptrs`) names its freed slot,
     and the next GEMV pass that routes it copies each chunk it reads from host memory into the slot as well
     (device-memory writes, no second trip over PCIe); the host publishes the slot address after accounting for
     that pass. A pass on the grouped GEMM (prefill) fills nothing: an armed expert it routes is copied instead
     (as below) and published at the next table write. An expert missed at pass N is admitted while pass N+1
     runs, armed for pass N+2 and resident at the earliest at pass N+4, only if pass N+2 routes it again.
   - "copy": it is copied at once, on a copy stream, behind the same table write (the copy stream waits for an
     event recorded on the compute stream after that write: the last pass that could read the victim's slot,
     or write it as a fill slot, was queued before it), at most COPY_BYTES_PER_PASS a pass (the rest wait for
     the next passes, read from the host meanwhile); the next table write publishes it with the compute stream
     waiting for the copies' event first (usually long done): resident from pass N+3 whether routed or not.
   - "copy-async": the same copies, published by the first table write at which an event query says they are
     done (no wait on the compute stream; the host is one pass ahead, so usually at pass N+4).
   Either way a kernel sees a valid old or new address, never a half-written slot: an address is published
   only behind its copy's event (or its fill pass), and a slot is written only after every pass that the table
   let read it as another expert's. `cache.md` has the simulated hit rate of each rule ("publication lag").
   By default (`cache_admission="frequency"`) a full cache admits a missed expert only when its count beats
   the weakest resident's, so a stable hot set is not churned by experts read once.
Table writes are ordered on the compute stream between passes (both tables, when they changed).

Checksums: on a device that reads the mapping directly, every blob is verified on the host at open (a thread
pool; `verify="never"` skips it), before any address is published to a table: no corrupt byte reaches a kernel.
The NumPy backend keeps verifying each blob on first read. When the mapping cannot be registered, the expert
section is copied once into pinned host memory (verified on the way) and read from there.

Prefetch (optional): the decoder applies the next MoE layer's router to the current layer's normalised hidden
state and the kernels count its predictions; the host scores them (recall, precision) and admits predicted
experts through the same cache.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from colibri_format.errors import InvalidInput

MEMORY_RESERVE = 2 << 30      # bytes of device memory left for activations, KV cache, cuBLAS workspace
COPY_BYTES_PER_PASS = 512 << 20  # admission copies queued per pass (at least one blob): a burst of admissions
                                 # (filling an empty cache) must not take the bus from the kernels' reads for long
EXPERT_LOADING = ("fill", "copy", "copy-async")   # how an admitted expert reaches its slot (module docstring)
VERIFY_THREADS = 8            # host threads hashing blobs at open (xxhash releases the GIL on large inputs)
SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
              "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}
MAX_MEMORY_BYTES = 1 << 50    # a budget beyond this is a typo


def parse_memory(value) -> int:
    """Bytes of a budget given as an integer or a string like '20GiB', '512MB', '1.5G' (binary for bare K/M/G)."""
    if isinstance(value, bool):
        raise InvalidInput("gpu_memory must be a size such as 20GiB", field="gpu_memory", value=value)
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in SIZE_UNITS or len(m.group(1)) > 20:
            raise InvalidInput("gpu_memory must be a size such as 20GiB, 512MB or a byte count", field="gpu_memory",
                               value=value)
        size = int(float(m.group(1)) * SIZE_UNITS[unit])
    if not 0 < size <= MAX_MEMORY_BYTES:
        raise InvalidInput("gpu_memory must be positive and at most 1 PiB", field="gpu_memory", value=value)
    return size


@dataclass
class PagingCounters:
    """Demand accesses (one per routed expert per layer per pass) and the bytes paging moved."""
    hits: int = 0                 # accesses served from a device slot
    misses: int = 0               # accesses the kernels read over PCIe from the host mapping
    loads: int = 0                # admissions loaded: filled on read, or copies queued into their slots
    fills: int = 0                # of those, filled by the GEMV kernels as they read the expert
    prefetch_loads: int = 0       # of those, admitted because the prefetch router predicted them
    bytes_paged: int = 0          # bytes copied into slots
    bytes_zero_copy: int = 0      # bytes the kernels read from host memory (a whole blob per miss)
    predicted: int = 0            # experts the prefetch router predicted (distinct per layer and pass)
    predicted_correct: int = 0    # of those, routed in that layer in the same pass
    actual_next: int = 0          # routed experts (distinct) of the layers that had a prediction
    copy_seconds: float = 0.0     # host time spent issuing copies
    stall_seconds: float = 0.0    # host time waiting for route totals and copies
    verify_seconds: float = 0.0   # host time verifying blobs at open
    tokens: int = 0
    touched: set = field(default_factory=set)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["touched"] = len(self.touched)
        acc = self.hits + self.misses
        d["hit_rate"] = self.hits / acc if acc else 0.0
        d["misses_per_token"] = self.misses / self.tokens if self.tokens else 0.0
        d["pcie_bytes_per_token"] = (self.bytes_paged + self.bytes_zero_copy) / self.tokens if self.tokens else 0.0
        d["stall_ms_per_token"] = 1e3 * self.stall_seconds / self.tokens if self.tokens else 0.0
        d["prefetch_recall"] = self.predicted_correct / self.actual_next if self.actual_next else 0.0
        d["prefetch_precision"] = self.predicted_correct / self.predicted if self.predicted else 0.0
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


def capacity_from_budget(budget: int, used: int, reserve: int, blob_size: int, scope: str, num_layers: int,
                         num_experts: int) -> int:
    """The max_cached_experts a GPU memory budget leaves room for after `used` (dense weights) and `reserve`
    (KV cache of one sequence and workspace); refused with the smallest budget that would run."""
    slots = (budget - used - reserve) // blob_size
    per_layer = slots // num_layers if scope == "per_layer" else slots
    if per_layer < 1:
        least = used + reserve + blob_size * (num_layers if scope == "per_layer" else 1)
        raise InvalidInput(f"gpu_memory {budget / 2**30:.2f} GiB leaves no room for experts after "
                           f"{used / 2**30:.2f} GiB of dense weights and a {reserve / 2**30:.2f} GiB reserve; "
                           f"at least {least / 2**30:.2f} GiB is needed", field="gpu_memory", value=budget)
    return int(min(per_layer, num_experts if scope == "per_layer" else num_layers * num_experts))


def check_budget(slots: int, blob_size: int, free: int, scope: str, num_layers: int, resident: bool) -> None:
    """A pool that cannot fit is refused with the largest max_cached_experts that would."""
    need = slots * blob_size
    usable = free - MEMORY_RESERVE
    if need <= usable:
        return
    fit = max(0, usable // blob_size)
    largest = fit // num_layers if scope == "per_layer" else fit
    what = "all experts" if resident else f"{slots} expert slots"
    raise InvalidInput(f"{what} need {need / 2**30:.2f} GiB of device memory but {max(usable, 0) / 2**30:.2f} GiB "
                       f"is free (after a {MEMORY_RESERVE >> 30} GiB reserve); the largest max_cached_experts that "
                       f"fits is {largest}" + (" (per layer)" if scope == "per_layer" else ""),
                       field="max_cached_experts", value=largest)


class HostSource:
    """Device-readable host addresses of every blob: the file mapping pinned in place, or, when registration
    fails, one copy of the expert section in pinned host memory (made once, verified on the way)."""

    def __init__(self, reader, be, layers: list[int], num_experts: int, verify: bool) -> None:
        self.reader, self.be = reader, be
        self.base, self.size = _mapping(reader)
        self.registered = False
        self.reason = ""
        self._pinned = None
        try:
            be.register_host(self.base, self.size)
            self.registered = True
            self.mode = "registered"
        except Exception as exc:  # noqa: BLE001 -- any failure: read a pinned copy instead
            self.mode = "pinned copy"
            self.reason = (f"cudaHostRegister of the file mapping failed ({exc}); the experts are read from a "
                           f"pinned copy in host memory")
        plan = reader.tables.plan
        self.first = plan.blob_offset(layers[0], 0) if layers else 0
        end = plan.blob_offset(layers[-1], num_experts - 1) + int(reader.blob_layout.size) if layers else 0
        if not self.registered:
            self._pinned = be.pinned_empty(max(end - self.first, 1))
        self.verify_seconds = self._verify_and_fill(layers, num_experts, verify)

    def addr(self, layer: int, expert: int) -> int:
        offset = self.reader.blob_offset(layer, expert)
        if self.registered:
            return self.base + offset
        return int(self._pinned.ctypes.data) + offset - self.first

    def _verify_and_fill(self, layers: list[int], num_experts: int, verify: bool) -> float:
        """Hash every blob (when asked) and fill the pinned copy (when there is one), before any table exists."""
        if not verify and self.registered:
            return 0.0
        t0 = time.perf_counter()
        view = np.frombuffer(memoryview(self.reader._map()), np.uint8)
        size = int(self.reader.blob_layout.size)

        def one(pair):
            layer, e = pair
            if verify:
                self.reader.verify_expert(layer, e)
            if not self.registered:
                off = self.reader.blob_offset(layer, e)
                self._pinned[off - self.first:off - self.first + size] = view[off:off + size]

        pairs = [(layer, e) for layer in layers for e in range(num_experts)]
        with ThreadPoolExecutor(min(VERIFY_THREADS, os.cpu_count() or 1)) as pool:
            for _ in pool.map(one, pairs):
                pass
        return time.perf_counter() - t0

    def close(self) -> None:
        self._pinned = None
        if self.registered:
            self.registered = False
            try:
                self.be.unregister_host(self.base)
            except Exception:  # noqa: BLE001 -- closing: nothing useful to do
                pass

    def __del__(self) -> None:
        # an engine dropped without close(): undo the registration while self.reader still keeps the mapping
        # alive (a range left registered after its munmap pins pages of a file that is gone, and the next file
        # mapped at that address is refused or read through the stale pages)
        self.close()


def _mapping(reader) -> tuple[int, int]:
    """(address, size) of the whole file mapping, found through a (verified) dense tensor's view of it."""
    entry = reader.tables.dense[0]
    view = reader.dense(entry.name)
    return int(view.ctypes.data) - int(entry.offset), int(reader.tables.file_size)


@dataclass
class _Snapshot:
    """The route totals copied behind one pass, the residency and fill slots the pass saw, whether it filled."""
    totals: np.ndarray
    event: object
    predicted: np.ndarray | None
    resident: np.ndarray
    armed: dict
    filled: bool


class ExpertPool:
    def __init__(self, reader, args, config, be, compute_stream, cache_factory, capacity: int | None = None,
                 prefetch: bool = False) -> None:
        self.reader, self.a, self.be = reader, args, be
        self.layout, self.blob_size = reader.blob_layout, int(reader.blob_layout.size)
        self.layers = sorted(args.moe_layers)
        self.E = int(reader.tables.plan.num_experts)
        self.scope, self.capacity = config.cache_scope, capacity
        self.loading = config.expert_loading                # checked by EngineConfig
        self.resident, self.slots = pool_plan(capacity, self.scope, len(self.layers), self.E)
        check_budget(self.slots, self.blob_size, be.free_memory(), self.scope, len(self.layers), self.resident)
        self.compute, self.copy_stream = compute_stream, be.new_stream()
        in_place = self.resident and be.host_is_device     # point into the file mapping: nothing to copy
        self.pool = be.empty(0 if in_place else self.slots * self.blob_size, np.uint8)
        self.base = be.ptr(self.pool)
        self.counters = PagingCounters()
        self.prefetch = bool(prefetch) and not self.resident
        self.tracking = not self.resident or be.host_is_device     # count routes (host-side stats, the cache)
        self.cache = None
        self.time_copies = False          # bracket each copy with timing events (paging GB/s)
        self._copy_times: list = []
        self.source = None
        try:
            verify = config.verify != "never" and not be.host_is_device and not self.resident
            self.source = HostSource(reader, be, self.layers, self.E, verify)
            self.counters.verify_seconds = self.source.verify_seconds
            self.host = np.array([[self.source.addr(layer, e) for e in range(self.E)] for layer in self.layers],
                                 np.uint64).reshape(len(self.layers), self.E)
            self._tables = np.stack([self.host, np.zeros_like(self.host)])   # what the device tables say
            self.mirror, self.fill_mirror = self._tables[0], self._tables[1]  # addresses read; slots to fill
            if in_place:
                self.load_seconds = 0.0
            elif self.resident:
                self._load_all(config.verify)
            else:
                self.cache = cache_factory(on_evict=self._on_evict)
            self._make_tables()
        except BaseException:      # e.g. a corrupt blob: never leave the file mapping registered behind us
            self.close()
            raise
        self.bytes_on_device = 0 if in_place else self.slots * self.blob_size

    # --- tables ---------------------------------------------------------------------------------------------
    def _make_tables(self) -> None:
        L, be = len(self.layers), self.be
        self._device_tables = be.to_device(self._tables)
        self.entries, fills = self._device_tables[0], self._device_tables[1]
        self.totals = be.zeros((L, self.E), np.uint32) if self.tracking else None
        self.predictions = be.zeros((L, self.E), np.uint32) if self.prefetch else None
        check = (lambda layer: (lambda e: self.reader.expert_blob(layer, e))) if be.host_is_device else None
        self.layer_tables = {
            layer: be.expert_table(self.entries[li], self.layout, check=check(layer) if check else None,
                                   route_totals=self.totals[li] if self.tracking else None,
                                   fill_ptrs=fills[li] if self.cache is not None and self.loading == "fill"
                                   else None)
            for li, layer in enumerate(self.layers)}
        self._seen = np.zeros((L, self.E), np.uint32)
        self._seen_predicted = np.zeros((L, self.E), np.uint32)
        self._snapshot: _Snapshot | None = None
        self._spare: list[np.ndarray] = [be.pinned_empty(L * self.E * 4).view(np.uint32).reshape(L, self.E)
                                         for _ in range(4 if self.prefetch else 2)] if self.tracking else []
        self._admitting: dict[tuple[int, int], int] = {}   # admitted by the cache, not yet armed: -> pool index
        self._armed: dict[tuple[int, int], int] = {}       # fill slot published: (li, e) -> pool index
        self._copying: dict[tuple[int, int], int] = {}     # to be copied (admitted, or routed by a GEMM pass while
                                                           # armed), not yet queued: (li, e) -> pool index
        self._pending: list[tuple[object, dict]] = []      # copies queued, not yet published, oldest first: (event
                                                           # behind them on the copy stream, {(li, e): slot address})
        self._dirty = False
        self._uploads = [(be.pinned_empty(self._tables.nbytes).view(np.uint64).reshape(self._tables.shape), None)
                         for _ in range(2)] if self.cache is not None else []
        self._upload_next = 0

    def table(self, layer: int):
        """The expert table the kernels of `layer` read (a fixed device array; its entries change between passes)."""
        return self.layer_tables[layer]

    def _slot_addr(self, index: int) -> int:
        return self.base + index * self.blob_size

    def resident_mask(self) -> np.ndarray:
        """[layers, E] True where a pass now reads the expert from the device's own memory (or the backend's)."""
        if self.resident:
            return np.ones(self.mirror.shape, bool)
        return self.mirror != self.host

    def _upload(self) -> None:
        """Both mirrors into the device tables, on the compute stream, from a pinned buffer of a pair (the other
        may still be in flight; the one reused here was queued two uploads ago)."""
        buf, event = self._uploads[self._upload_next]
        if event is not None:
            self.be.sync_event(event)
        buf[...] = self._tables
        self.be.copy_htod(self.be.ptr(self._device_tables), int(buf.ctypes.data), buf.nbytes, self.compute)
        self._uploads[self._upload_next] = (buf, self.be.record(self.compute))
        self._upload_next ^= 1

    # --- resident -----------------------------------------------------------------------------------------
    def _load_all(self, verify: str) -> None:
        """One copy per layer (its blobs are contiguous in the file), after verifying each blob on the host."""
        t0 = time.perf_counter()
        for li, layer in enumerate(self.layers):
            if verify != "never":
                for e in range(self.E):
                    self.reader.verify_expert(layer, e)
            self.be.copy_htod(self._slot_addr(li * self.E), self.source.addr(layer, 0), self.E * self.blob_size,
                              self.copy_stream)
            self.mirror[li] = [self._slot_addr(li * self.E + e) for e in range(self.E)]
        self.be.sync_event(self.be.record(self.copy_stream))
        self.load_seconds = time.perf_counter() - t0
        self.counters.bytes_paged += len(self.layers) * self.E * self.blob_size
        self.source.close()            # a pinned copy made for this load is not needed any more
        if self.source.mode == "registered":
            self.source.mode = "registered (released after loading)"

    # --- prefetch -----------------------------------------------------------------------------------------------
    def prefetch_layer(self, layer: int) -> int | None:
        """The MoE layer whose experts to predict while `layer` computes (None: no prefetch)."""
        if not self.prefetch:
            return None
        i = self.layers.index(layer)
        return self.layers[i + 1] if i + 1 < len(self.layers) else None

    def predict(self, layer: int, ids) -> None:
        """Count the prefetch router's choices for `layer` (read by the host with the pass's route totals)."""
        self.be.count_routes(ids, self.predictions[self.layers.index(layer)])

    # --- the cache, between passes ------------------------------------------------------------------------------
    def after_pass(self, rows: int) -> None:
        """Queue this pass's (of `rows` tokens) route totals, then run the cache on the previous pass's (see the
        module docstring)."""
        if not self.tracking:
            return
        be, previous = self.be, self._snapshot
        buf = self._spare.pop()
        be.copy_to_host_async(buf, self.totals, self.compute)
        pred = None
        if self.prefetch:
            pred = self._spare.pop()
            be.copy_to_host_async(pred, self.predictions, self.compute)
        filled = be.fills_on_read(rows, self.a.top_k, self.E)
        self._snapshot = _Snapshot(buf, be.record(self.compute), pred, self.resident_mask(), dict(self._armed), filled)
        if previous is not None:
            self._account(previous)

    def flush(self) -> None:
        """Account for the last pass now (stats): waits for it."""
        if self._snapshot is not None:
            snap, self._snapshot = self._snapshot, None
            self._account(snap)

    def _account(self, snap: _Snapshot) -> None:
        t0 = time.perf_counter()
        self.be.sync_event(snap.event)
        self.counters.stall_seconds += time.perf_counter() - t0
        routed = (snap.totals - self._seen) != 0            # uint32: the difference wraps like the totals
        self._seen[...] = snap.totals
        self._spare.append(snap.totals)
        predicted = None
        if snap.predicted is not None:
            predicted = (snap.predicted - self._seen_predicted) != 0
            self._seen_predicted[...] = snap.predicted
            self._spare.append(snap.predicted)
            self._score(predicted, routed)
        li, ex = np.nonzero(routed)
        c = self.counters
        c.touched.update(zip((self.layers[i] for i in li.tolist()), ex.tolist()))
        if self.cache is None:                # all resident: nothing is paged, only what was touched is counted
            return
        hit = snap.resident[li, ex]
        c.hits += int(hit.sum())
        c.misses += int((~hit).sum())
        c.bytes_zero_copy += int((~hit).sum()) * self.blob_size
        self._settle_fills(snap, routed)
        for i, e in zip(li.tolist(), ex.tolist()):
            self._access(i, e)
        if predicted is not None:
            for i, e in zip(*np.nonzero(predicted & ~self.resident_mask())):
                c.prefetch_loads += self._access(int(i), int(e))
        self._apply()

    def _settle_fills(self, snap: _Snapshot, routed: np.ndarray) -> None:
        """Armed experts the pass routed: filled (GEMV pass) -> publish the slot; not (GEMM pass) -> copy them."""
        for key, index in snap.armed.items():
            if not routed[key] or self._armed.get(key) != index:     # not read, or evicted since
                continue
            del self._armed[key]
            self.fill_mirror[key] = 0
            self._dirty = True
            if snap.filled:
                self.mirror[key] = self._slot_addr(index)
                self.counters.loads += 1
                self.counters.fills += 1
            else:
                self._copying[key] = index

    def _score(self, predicted: np.ndarray, routed: np.ndarray) -> None:
        layers = predicted.any(axis=1)
        c = self.counters
        c.predicted += int(predicted.sum())
        c.actual_next += int(routed[layers].sum())
        c.predicted_correct += int((predicted & routed).sum())

    def _access(self, li: int, e: int) -> int:
        """One access for the cache; 1 when it admits the expert into a slot (copied in `_apply`)."""
        layer = self.layers[li]
        held = self.cache.contains(layer, e)
        self.cache.get(layer, e, lambda: None, nbytes=self.blob_size)
        slot = self.cache.slot_of(layer, e)
        if held or slot is None:              # a hit, or served without admission (static policy)
            return 0
        self._admitting[(li, e)] = li * self.capacity + slot if self.scope == "per_layer" else slot
        return 1

    def pending_keys(self) -> set:
        """Experts whose copies are queued and not yet published: (li, e)."""
        return {key for _, batch in self._pending for key in batch}

    def _on_evict(self, layer: int, expert: int, slot: int, value) -> None:
        """The victim's entry points back at the host at the next table write; a copy of it not yet published (or
        not yet queued: admitted and evicted between two passes) is dropped, as its slot now belongs to another
        (whose own copy is queued behind it on the copy stream, so the slot ends up holding the new expert)."""
        key = (self.layers.index(layer), expert)
        for state in (self._admitting, self._armed, self._copying):
            state.pop(key, None)
        for _, batch in self._pending:
            batch.pop(key, None)
        self.mirror[key] = self.host[key]
        self.fill_mirror[key] = 0
        self._dirty = True

    def _apply(self) -> None:
        """One table write: finished copies and filled slots published, this pass's evictions, the newly admitted
        experts armed for fill on read ("fill") or queued for copying; then the copies, behind the write."""
        be = self.be
        self._publish()
        if self.loading == "fill":
            for key, index in self._admitting.items():
                self._armed[key] = index
                self.fill_mirror[key] = self._slot_addr(index)
                self._dirty = True
        else:
            self._copying.update(self._admitting)          # after any left over by the budget: oldest first
        self._admitting = {}
        if self._dirty:
            self._upload()
            self._dirty = False
        if not self._copying:
            return
        # The copy stream waits for everything queued on the compute stream so far: the passes that may still read
        # a victim's slot (or fill it, armed for another) were all queued before the table write just above, which
        # pointed their entries back at the host; the passes after it cannot reach the slots being written.
        be.wait(self.copy_stream, be.record(self.compute))
        budget = max(1, COPY_BYTES_PER_PASS // self.blob_size)
        batch = {}
        for key in list(self._copying)[:budget]:          # the rest wait for the next passes (read from the host)
            index = self._copying.pop(key)
            self._copy(index, int(self.host[key]))
            batch[key] = self._slot_addr(index)
        self._pending.append((be.record(self.copy_stream), batch))

    def _publish(self) -> None:
        """Point the entries of copied experts at their slots: every queued batch, the compute stream waiting for
        the last one's event first ("fill", "copy"); or ("copy-async", on a backend with event queries) only the
        batches whose event has completed, leaving the rest for a later table write. Batches are in copy-stream
        order, so a completed event means every batch before it is done too."""
        if not self._pending:
            return
        done = len(self._pending)
        query = getattr(self.be, "event_done", None) if self.loading == "copy-async" else None
        if query is not None:
            done = 0
            while done < len(self._pending) and query(self._pending[done][0]):
                done += 1
            if not done:
                return
        self.be.wait(self.compute, self._pending[done - 1][0])    # free when complete (always for copy-async)
        for _, batch in self._pending[:done]:
            for key, addr in batch.items():
                self.mirror[key] = addr
                self._dirty = True
        del self._pending[:done]

    def _copy(self, index: int, src: int) -> None:
        t0 = time.perf_counter()
        start = self.be.timing_event(self.copy_stream) if self.time_copies else None
        self.be.copy_htod(self._slot_addr(index), src, self.blob_size, self.copy_stream)
        if start is not None:
            self._copy_times.append((start, self.be.timing_event(self.copy_stream)))
        self.counters.copy_seconds += time.perf_counter() - t0
        self.counters.loads += 1
        self.counters.bytes_paged += self.blob_size

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
        if self.source is not None:
            self.source.close()
        self.pool = None
        self.layer_tables = {}

"""The engine: one class over one decoder, on the NumPy backend (device="cpu") or the CUDA one (device="cuda").

    with Engine("model.colibri", EngineConfig(device="cuda", max_cached_experts=64)) as eng:
        eng.infer([[1, 2, 3], [4, 5]])                   # next token id per sequence
        eng.generate([1, 2, 3], max_new_tokens=32)       # GenerationResult(output_ids, text, stats)

Dense weights are loaded once as the backend keeps them. Experts live in an `ExpertPool`: all resident when they
fit in `max_cached_experts` / `gpu_memory` (or neither is set), else paged: the kernels read a missing expert
from the registered file mapping and the `ExpertCache` runs between passes. Prefill is one eager packed pass;
decode steps go through a `DecodeRunner`, captured as a CUDA graph when the backend has graphs and nothing in the
step needs the host (`stats()["graphs"]` says why not otherwise), paged or not.
`colibri_init` / `colibri_infer` / `colibri_free` are the C-style names users know from the original project.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from colibri_format.errors import InvalidInput, UnsupportedModel
from colibri_format.runtime.args import ModelArgs
from colibri_format.runtime.cache.expert_cache import ADMISSIONS, CLOCKS, ENGINE_POLICIES, SCOPES, ExpertCache
from colibri_format.runtime.cuda.limits import DENSE_GEMMS
from colibri_format.runtime.expert_pool import (EXPERT_LOADING, MEMORY_RESERVE, ExpertPool, capacity_from_budget,
                                                 parse_memory)
from colibri_format.runtime.forward import Decoder, StepInputs, Workspace, host_step, make_kv
from colibri_format.runtime.inputs import check_batch, prompt_ids
from colibri_format.runtime.rope import rotary_dim
from colibri_format.runtime.runner import (CHAIN_STEPS, PREFILL_GRAPH_MAX_ROWS, PREFILL_GRAPHS_KEPT, DecodeRunner,
                                           PrefillRunner, capacity_for, prefill_bucket)
from colibri_format.runtime.sampling import Sampler, StopStrings

RouteObserver = Callable[[int, int, int, np.ndarray, int], None]  # (step, seq, layer, experts [P, k], pos0)
# the values EngineConfig's string fields take (the CLI's options check them through the same table)
CONFIG_CHOICES = {"kv_cache_dtype": ("auto", "bfloat16"), "dense_gemm": DENSE_GEMMS, "cache_policy": ENGINE_POLICIES,
                  "cache_scope": SCOPES, "cache_clock": CLOCKS, "cache_admission": ADMISSIONS,
                  "expert_loading": EXPERT_LOADING}


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"                       # "cpu" (NumPy backend) or "cuda" (CuPy kernels)
    device_id: int = 0
    precision: str = "float32"                # device="cpu": float32, or float64 (the oracle kernels are tested by)
    max_batch_size: int = 32
    max_seq_len: int = 2048
    max_prefill_rows: int = 4096              # rows of one prefill pass: a longer prompt (or packed batch) runs in
                                              # several passes, each continuing the last (same results up to
                                              # rounding); bounds the pass's activations and workspace
    max_cached_experts: int | None = None     # None: keep every expert once loaded
    gpu_memory: int | str | None = None       # a device memory budget ("20GiB"): sizes the expert cache from what
                                              # dense weights, one sequence's KV cache and a workspace leave
    use_graphs: bool = True                   # CUDA: capture decode steps as graphs where possible
    prefetch: bool = False                    # paged experts: predict the next layer's experts and copy them early
    bf16_tensor_cores: bool = True            # CUDA: bf16 matrices beyond 8 rows on the tensor cores (else f32 cuBLAS)
    fast_expert_gemm: str | None = "auto"     # CUDA: the prefill grouped expert GEMM on the pipelined kernel
                                              # (moe_gemm_fast.cu) with activations 'split' (bf16 hi + lo, ~1e-5)
                                              # or 'bf16' (~1e-3, faster); 'int8': W8A8, inputs rounded to int8
                                              # a row (docs/quality.md), on cuBLAS's int8 tensor cores for large
                                              # experts, else the pipelined kernel's s8 MMAs, for passes of more
                                              # than 32 rows ('split' below); 'auto': 'int8'
                                              # where an expert's mean work reaches limits.
                                              # W8A8_MIN_EXPERT_MACS (Mixtral from ~20 tokens, Qwen3 from
                                              # ~410, OLMoE from ~160), else 'split'; None: moe_gemm.cu's
                                              # 64x64 tc kernel
    cublas_expert_gemm: bool | None = None    # CUDA: that GEMM as cuBLAS bf16 products of widened int8 experts
                                              # (moe_gemm_cublas.cu, same activations); None: for experts
                                              # of large mean work (limits.CUBLAS_MIN_EXPERT_MACS)
    flash_prefill: bool = True                # CUDA: prefill attention (beyond 32 rows) as flash attention on the
                                              # tensor cores, operands split into bf16 hi + lo (attention_prefill.cu);
                                              # off: attention_split (fp32 SIMT). docs/benchmarks.md has both timed
    int8_activations: bool = True             # int4_group experts (limits.A8_FORMATS): each expert product rounds
                                              # its input to int8 per group of 32 (s = max|v| / 127, symmetric);
                                              # CUDA decode passes run the dp4a GEMVs (moe_gemv4_dp4a.cu), prefill
                                              # the grouped GEMM on the rounded inputs; the NumPy engine rounds the
                                              # same way (docs/quality.md). Off: float activations (other formats
                                              # always)
    dense_gemm: str = "split"                 # prefill-shaped products of bf16 dense matrices (more than 32 rows) on
                                              # the tensor cores: x split into bf16 hi + lo (two products, ~1e-5),
                                              # or "bf16": x rounded to bf16 (one product; +0.004% perplexity on the
                                              # bundled model, docs/quality.md); limits.rounds_dense_bf16, both engines
    kv_cache_dtype: str = "auto"              # keys and values cached as computed ("auto": float32, float64 with
                                              # precision="float64") or as "bfloat16" (half the bytes; rounded to
                                              # nearest even: docs/quality.md). MLA's latent cache stays "auto"
    verbose: bool = False
    cache_policy: str = "lrfu"                # lru | lfu | lrfu | static | random
    cache_scope: str = "global"               # global | per_layer
    decay_factor: float = 0.999
    cache_clock: str = "token"                # LRFU clock: per token (half-life 693 tokens at decay 0.999: with
                                              # frequency admission, 2-10x fewer copies than the access clock at
                                              # the same hit rate on a Zipf trace, docs/cache.md) or per access
    cache_history: bool = True                # lfu/lrfu keep an evicted expert's count (best online policy
                                              # on the demo model's real traces, docs/cache.md)
    cache_admission: str = "frequency"        # lfu/lrfu with history: admit a missed expert only when its count
                                              # beats the weakest resident's (else it is read over PCIe); always
    expert_loading: str = "fill"              # paged experts: how an admitted expert reaches its slot. fill: the
                                              # GEMV kernels write what they read of it (no second PCIe trip),
                                              # published after the next pass that routes it is accounted;
                                              # copy: copied at admission on a copy stream, published at the next
                                              # table write (the compute stream waits for the copies there);
                                              # copy-async: the same copies, published once an event query says
                                              # they are done (never a wait; usually a pass later). docs/cache.md
    verify: str = "first-use"                 # never | first-use | always (expert and tensor checksums)
    trace_path: str | None = None             # write a routing trace (JSON Lines) here
    pinned_experts: tuple | None = None       # (layer, expert) pairs for cache_policy="static"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "max_prefill_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{name} must be a positive integer", field=name, value=value)
        if self.device not in ("cpu", "cuda"):
            raise InvalidInput("device must be 'cpu' or 'cuda'", field="device", value=self.device)
        if self.gpu_memory is not None:
            if self.max_cached_experts is not None:
                raise InvalidInput("give max_cached_experts or gpu_memory, not both", field="gpu_memory",
                                   value=self.gpu_memory)
            object.__setattr__(self, "gpu_memory", parse_memory(self.gpu_memory))
        for name, choices in CONFIG_CHOICES.items():   # here: a cache is only made when experts are paged
            if getattr(self, name) not in choices:
                raise InvalidInput(f"{name} must be one of {', '.join(choices)}", field=name, value=getattr(self, name))
        d = self.decay_factor
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < float(d) <= 1.0:   # NaN too
            raise InvalidInput("decay_factor must be a number in (0, 1]", field="decay_factor", value=d)
        if self.fast_expert_gemm not in (None, "auto", "split", "bf16", "int8"):
            raise InvalidInput("fast_expert_gemm must be None, 'auto', 'split', 'bf16' or 'int8'",
                               field="fast_expert_gemm", value=self.fast_expert_gemm)
        if not (self.cublas_expert_gemm is None or isinstance(self.cublas_expert_gemm, bool)):   # 1, 0 refused
            raise InvalidInput("cublas_expert_gemm must be None, True or False", field="cublas_expert_gemm",
                               value=self.cublas_expert_gemm)
        if self.precision not in ("float32", "float64") or (self.device == "cuda" and self.precision != "float32"):
            raise InvalidInput("precision must be 'float32', or 'float64' on device='cpu'", field="precision",
                               value=self.precision)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    experts_touched: int = 0                  # distinct (layer, expert) pairs the router picked (when the routing
                                              # reaches the host anyway: paged experts, or the NumPy backend)
    cache_hits: int = 0
    cache_misses: int = 0
    expert_loads: int = 0
    bytes_paged: int = 0                      # copied into device slots
    bytes_zero_copy: int = 0                  # read by the kernels straight from host memory (misses)
    stall_seconds: float = 0.0                # host time waiting for route totals and copies
    finish_reason: str = "length"             # length | stop | callback | max_seq_len

    def set_rates(self) -> None:
        """Tokens/s of prefill, and of decode (the first new token comes out of the prefill pass)."""
        self.prefill_tokens_per_s = self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0
        decoded = max(self.generated_tokens - 1, 0)
        self.decode_tokens_per_s = decoded / self.decode_seconds if decoded and self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The counters plus the paging view: hit rate, misses per token, GB/s paged, stall per token."""
        d = asdict(self)
        tokens = self.prompt_tokens + self.generated_tokens
        accesses = self.cache_hits + self.cache_misses
        seconds = self.prefill_seconds + self.decode_seconds
        # 1 when no expert went through the cache (all resident): what serve's /metrics reports too
        d["hit_rate"] = self.cache_hits / accesses if accesses else 1.0
        d["misses_per_token"] = self.cache_misses / tokens if tokens else 0.0
        d["paged_gb_per_s"] = (self.bytes_paged + self.bytes_zero_copy) / seconds / 1e9 if seconds else 0.0
        d["stall_ms_per_token"] = 1e3 * self.stall_seconds / tokens if tokens else 0.0
        return d


@dataclass
class GenerationResult:
    output_ids: list[int]
    text: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)


def _check_new_tokens(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InvalidInput("max_new_tokens must be an integer >= 0", field="max_new_tokens", value=max_new_tokens)


def _check_pinned(pinned, moe_layers, num_experts: int) -> None:
    """Pinned (layer, expert) pairs must name experts of this file (a trace of another model pins nothing)."""
    for pair in pinned or ():
        ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in pair)
        if not ok or int(pair[0]) not in moe_layers or not 0 <= int(pair[1]) < num_experts:
            raise InvalidInput(f"pinned expert {pair!r} is not a (MoE layer, expert) of this file "
                               f"({len(moe_layers)} MoE layers, {num_experts} experts)", field="pinned_experts",
                               value=repr(pair)[:64])


def _check_index_topk(args, config: EngineConfig) -> None:
    """A DSA checkpoint converted without its indexer (model.index_topk) is exact only while a context holds at most
    index_topk tokens (the indexer keeps them all): an engine for longer contexts is refused."""
    k = args.index_topk
    if k is not None and config.max_seq_len > k:
        raise UnsupportedModel(f"max_seq_len {config.max_seq_len} exceeds model.index_topk = {k}: this file has no "
                               f"sparse-attention indexer, and its dense attention equals the model's only up to {k} "
                               f"tokens (set max_seq_len <= {k})", field="model.index_topk", value=k)


def make_cache(config: EngineConfig, capacity: int | None, on_evict=None):
    pinned = [tuple(p) for p in config.pinned_experts] if config.pinned_experts is not None else None
    history = config.cache_history and config.cache_policy in ("lfu", "lrfu")
    cache = ExpertCache(capacity, policy=config.cache_policy, scope=config.cache_scope,
                        decay=config.decay_factor, clock=config.cache_clock, pinned=pinned, history=history,
                        admission=config.cache_admission if history else "always")
    cache.on_evict = on_evict
    return cache


def make_backend(config: EngineConfig):
    """The backend of `config.device`; CuPy is imported only for device="cuda"."""
    if config.device == "cpu":
        from colibri_format.runtime.numpy_backend import NumpyBackend

        return NumpyBackend(np.dtype(config.precision), int8_activations=config.int8_activations,
                            fast_expert_gemm=config.fast_expert_gemm, dense_gemm=config.dense_gemm,
                            bf16_tensor_cores=config.bf16_tensor_cores)
    try:
        from colibri_format.runtime.cuda.backend import make_backend as make_cuda_backend
    except ImportError as exc:
        raise InvalidInput(f"device='cuda' needs CuPy ({exc})", field="device", value="cuda") from None
    return make_cuda_backend(config.device_id, bf16_tensor_cores=config.bf16_tensor_cores,
                             fast_expert_gemm=config.fast_expert_gemm, flash_prefill=config.flash_prefill,
                             int8_activations=config.int8_activations,
                             cublas_expert_gemm=config.cublas_expert_gemm, dense_gemm=config.dense_gemm)


MAX_RUNNERS = 2   # decode runners kept (each holds KV buffers for its batch size and capacity)


def prefill_passes(lengths: list[int], max_rows: int) -> list[list[tuple[int, int, int]]]:
    """Passes of at most `max_rows` rows over sequences of `lengths`: each pass a list of (sequence, first row,
    end row); sequences in order, each split where a pass fills up."""
    passes, current, room = [], [], max_rows
    for i, n in enumerate(lengths):
        a = 0
        while a < n:
            b = min(n, a + room)
            current.append((i, a, b))
            room -= b - a
            a = b
            if room == 0:
                passes.append(current)
                current, room = [], max_rows
    return passes + ([current] if current else [])


class _RouteLog:
    """Fans the model's per-layer routing out to (sequence, position) rows: trace file and observers."""

    def __init__(self, model: dict, trace_path: str | None, name: str = "unknown") -> None:
        self.observers: list[RouteObserver] = []
        self.writer = None
        if trace_path is not None and model.get("moe_layers"):
            from colibri_format.runtime.cache.trace import TraceWriter

            self.writer = TraceWriter(trace_path, num_layers=model["num_layers"], moe_layers=model["moe_layers"],
                                      num_experts=model["num_experts"], top_k=model["top_k"],
                                      model=name)
        self._rows: list[tuple[int, slice, int]] = []
        self._step = 0

    def begin(self, step: int, seqs: Sequence[int], chunks: list[np.ndarray], starts: list[int]) -> None:
        bounds = np.cumsum([0] + [len(c) for c in chunks])
        self._step = step
        self._rows = [(s, slice(int(b), int(e)), p) for s, b, e, p in zip(seqs, bounds[:-1], bounds[1:], starts)]

    def record(self, layer: int, idx: np.ndarray) -> None:
        for seq, span, pos in self._rows:
            if self.writer is not None:
                self.writer.record(self._step, seq, layer, idx[span], pos=pos)
            for observe in self.observers:
                observe(self._step, seq, layer, idx[span], pos)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _serialized(method):
    """One call at a time on an engine: threads sharing it get the serial results, traces and stats (calls
    queue on the engine's lock); a call after `close()` is refused with InvalidInput."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            if self.closed:
                raise InvalidInput("the engine is closed", field="engine")
            return method(self, *args, **kwargs)
    return call


def _labelled(items) -> dict:
    """{label: status} of kept runners; a label met again (runners of the same rows into other KV, or kept under
    other kernel choices) gets " #2", " #3", ... so that every runner shows."""
    out: dict = {}
    for label, status in items:
        n, name = 1, label
        while name in out:
            n += 1
            name = f"{label} #{n}"
        out[name] = status
    return out


class Engine:
    """generate / infer / logits / stats / tokenizer / close over a `.colibri` file (a path)."""

    def __init__(self, source: str | os.PathLike, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        if not isinstance(source, (str, os.PathLike)):
            raise InvalidInput("an engine reads a .colibri file path", field="source", value=type(source).__name__)
        import colibri_format  # late: the package's __init__ imports the reader, which is all we need of it

        self.closed = True
        self._lock = threading.RLock()
        self.reader = colibri_format.open(os.fspath(source), verify=self.config.verify)
        self.experts = None
        try:
            self._setup()
        except BaseException:
            if self.experts is not None:
                self.experts.close()
            self.reader.close()
            raise
        self.closed = False

    def _setup(self) -> None:
        cfg = self.config
        self.metadata = self.reader.metadata
        self.args = ModelArgs.from_dict(self.reader.model)
        self.half = rotary_dim(self.args.rope, self.args.rope_head_dim) // 2
        _check_index_topk(self.args, cfg)
        _check_pinned(cfg.pinned_experts, self.args.moe_layers, self.reader.model.get("num_experts") or 0)
        self.be = make_backend(cfg)
        self.be.check_support(self.reader.model, self.reader.blob_layout if self.args.moe_layers else None)
        # keys and values cached as computed, or as bf16 bits (uint16); MLA's latent cache is always as computed
        self.kv_dtype = np.dtype(np.uint16 if cfg.kv_cache_dtype == "bfloat16" else self.be.dtype)
        self.stream = self.be.new_stream()
        self.be.host_stream = self.stream
        t0 = time.perf_counter()
        with self.stream:
            self.dense = self.be.dense(self.reader)
            capacity = self._cache_capacity()
            self.experts = ExpertPool(self.reader, self.args, cfg, self.be, self.stream,
                                      lambda on_evict: make_cache(cfg, capacity, on_evict), capacity,
                                      prefetch=cfg.prefetch)
        self.be.synchronize()        # uploads made outside the compute stream are done before it runs
        self.load_seconds = time.perf_counter() - t0
        self.cache = self.experts.cache
        self.decoder = Decoder(self.args, self.dense, self.experts, self.be)
        self.routes = _RouteLog(self.reader.model, cfg.trace_path, str(self.metadata.get("architecture", "unknown")))
        # keys end with be.kernel_choices(): a graph captured under other kernel switches is not replayed
        self._runners: dict[tuple, DecodeRunner] = {}             # (batch, capacity, choices)
        self._prefill_runners: dict[tuple, PrefillRunner] = {}   # (rows, id of the KV or None, choices), by recency
        self._tokenizer: Any = None
        self._step = 0
        # greedy decode steps queued at once (`DecodeRunner.chain`): 1 where the backend runs each op as it is
        # called (a longer chain would only compute tokens past a stop)
        self.chain_steps = CHAIN_STEPS if self.be.runs_ahead else 1

    def new_kv(self, seqs: int, capacity: int):
        """Zeroed KV buffers (and recurrent state) of `seqs` sequences x `capacity` positions, keys and values in
        the engine's `kv_cache_dtype` (`forward.make_kv`); on the current stream."""
        return make_kv(self.be, self.args, seqs, capacity, self.kv_dtype)

    def _cache_capacity(self) -> int | None:
        """max_cached_experts, or what the gpu_memory budget leaves for experts (None: all resident)."""
        cfg, a = self.config, self.args
        if cfg.gpu_memory is None or not a.moe_layers:
            return cfg.max_cached_experts
        kv_one_sequence = cfg.max_seq_len * a.kv_values_per_token * (self.be.dtype if a.mla else self.kv_dtype).itemsize
        return capacity_from_budget(cfg.gpu_memory, self.dense.nbytes, kv_one_sequence + MEMORY_RESERVE,
                                    int(self.reader.blob_layout.size), cfg.cache_scope, len(a.moe_layers),
                                    int(self.reader.model.get("num_experts") or 0))

    # --- properties -------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def tokenizer(self):
        """The file's embedded tokenizer, or None when the file has none."""
        if self._tokenizer is None:
            from colibri_format.runtime.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_metadata(self.metadata) or False
        return self._tokenizer or None

    def graph_blocker(self, batch: int) -> str | None:
        """Why a decode step of `batch` rows cannot be captured as a graph, or None."""
        if not self.be.graphs:
            return f"the {self.be.name} backend has no graphs"
        if not self.config.use_graphs:
            return "graphs disabled"
        return self.be.graph_blocker(self.args, batch)

    @_serialized
    def stats(self) -> dict:
        """Engine-level state: expert residency and paging counters, graph status, memory."""
        graphs = _labelled((f"{b}x{c}", "captured" if r.graph is not None else r.reason)
                           for (b, c, _), r in self._runners.items())
        prefill = _labelled((f"{r.rows}" if own is None else f"{r.rows} into a decode runner",
                             "captured" if r.graph is not None else r.reason or "eager (first use)")
                            for (_, own, _), r in self._prefill_runners.items())
        ex = self.experts
        ex.flush()
        out = {"backend": self.be.name, "resident": ex.resident, "slots": ex.slots, "blob_bytes": ex.blob_size,
               "capacity": ex.capacity, "expert_bytes_on_device": ex.bytes_on_device, "dense_bytes": self.dense.nbytes,
               "host_source": ex.source.mode, "host_source_note": ex.source.reason, "expert_loading": ex.loading,
               "load_seconds": self.load_seconds, "graphs": graphs, "prefill_graphs": prefill,
               "kv_cache_dtype": "bfloat16" if self.kv_dtype == np.uint16 and not self.args.mla else self.be.dtype.name,
               "paging": ex.counters.as_dict()}
        if self.cache is not None:
            s = self.cache.stats()
            out["cache"] = {"hits": s.hits, "misses": s.misses, "evictions": s.evictions, "hit_rate": s.hit_rate}
        return out

    # --- inference --------------------------------------------------------------------------------------
    @_serialized
    def logits(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Logits of every position, [n_i, vocab] float32 per sequence (a fresh KV cache for each)."""
        chunks = self._check(batch)
        out = self.be.to_host(self._prefill_fresh(chunks, all_logits=True)).astype(np.float32, copy=False)
        return list(np.split(out, np.cumsum([len(c) for c in chunks])[:-1]))

    @_serialized
    def infer(self, batch: Sequence[Sequence[int]]) -> list[int]:
        """Greedy next token id per sequence after a batched prefill."""
        chunks = self._check(batch)
        return [int(np.argmax(row)) for row in self.be.to_host(self._prefill_fresh(chunks))]

    @_serialized
    def generate(self, prompt_ids: Sequence[int] | str, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_ids: Sequence[int] | None = None,
                 callback: Callable[[int], Any] | None = None, *, top_k: int = 0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, stop_strings: Sequence[str] | None = None) -> GenerationResult:
        """Prefill the prompt, then decode one token per step; `callback(token_id)` returning False stops.

        Sampling (runtime/sampling.py): repetition_penalty over the prompt and the output (1 = off), then greedy
        at temperature 0, else temperature, top_k (0 = off), top_p (1 = off), min_p (0 = off). Generation stops
        at a token of `stop_ids` (default: the tokenizer's end tokens) or once the decoded text holds one of
        `stop_strings` (needs the file's tokenizer); `text` then ends before that string.
        """
        prompt = self._prompt(prompt_ids)
        pick = Sampler(temperature, top_p, seed, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                       context=prompt.tolist())
        _check_new_tokens(max_new_tokens)
        stop = set(self._stop_ids() if stop_ids is None else stop_ids)
        stop_text = StopStrings(stop_strings, self.tokenizer) if stop_strings else None
        c0 = self._counts()
        stats = GenerationStats(prompt_tokens=len(prompt))
        out = self._decode(prompt, max_new_tokens, pick, stop, stop_text, callback, stats)
        self._finish_stats(stats, c0)
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        if stop_text is not None and text is not None:
            text = stop_text.cut(text)
        if self.config.verbose:
            print(f"colibri({self.be.name}): {stats.as_dict()}", file=sys.stderr)
        return GenerationResult(out, text, stats)

    @_serialized
    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding of several prompts at once (one decode runner for the batch); token ids per prompt."""
        chunks = self._check(prompts)
        _check_new_tokens(max_new_tokens)
        if max_new_tokens == 0:
            return [[] for _ in chunks]
        need = max(len(c) for c in chunks) + max_new_tokens
        if need > self.config.max_seq_len:
            raise InvalidInput(f"prompt + max_new_tokens = {need} exceeds max_seq_len={self.config.max_seq_len}",
                               field="max_new_tokens", value=max_new_tokens)
        runner = self.decode_runner(len(chunks), need)
        outs = [[t] for t in self.argmax(self.prefill_into(runner, chunks))]
        pos = np.array([len(c) for c in chunks])
        for start in range(0, max_new_tokens - 1, self.chain_steps):
            tokens = self._chain(runner, np.array([o[-1] for o in outs]), pos + start,
                                 min(self.chain_steps, max_new_tokens - 1 - start))
            for o, column in zip(outs, tokens.T):
                o.extend(int(t) for t in column)
        return outs

    # --- step-level access (generate_batch, benchmarks, colibri serve) -------------------------------------------
    @_serialized
    def decode_runner(self, batch: int, length: int, kv=None) -> DecodeRunner:
        """The runner for `batch` sequences of up to `length` tokens (kept: later calls reuse its graph).

        With `kv` (another runner's `kv`, or `new_kv` buffers of at least `batch` sequences and `length` positions)
        a new runner over those buffers, stepping their sequences 0..batch-1: not kept by the engine (the caller
        keeps it, and its graph). colibri serve steps its running requests through runners of 1, 2, 4, ... rows
        over the buffers of all its slots."""
        if kv is not None:
            if not 1 <= batch <= kv.seqs or length > kv.capacity:
                raise InvalidInput(f"a runner of {batch} rows and {length} positions does not fit KV buffers of "
                                   f"{kv.seqs} sequences x {kv.capacity} positions", field="batch", value=batch)
            with self.stream:
                return DecodeRunner(self, batch, kv.capacity, kv)
        capacity = capacity_for(length, self.config.max_seq_len)
        key = (batch, capacity, self.be.kernel_choices())
        if key not in self._runners:
            while len(self._runners) >= MAX_RUNNERS:
                self._runners.pop(next(iter(self._runners)))
            with self.stream:
                self._runners[key] = DecodeRunner(self, batch, capacity)
        return self._runners[key]

    @_serialized
    def prefill_into(self, runner: DecodeRunner, chunks: list[np.ndarray], seqs: Sequence[int] | None = None,
                     starts: Sequence[int] | None = None):
        """Write chunks[i] into the runner's sequence seqs[i] (default i) from position starts[i] (default 0), in one
        packed pass; device logits [S, V] of each chunk's last row. Positions before starts[i] must hold that
        sequence's earlier tokens; what lies beyond a sequence's end is never read (a serving loop reuses slots and
        extends only some of them). A slot is any sequence of the runner's KV buffers (shared buffers may hold more
        than the runner's rows). Raises InvalidInput for a slot outside them, a slot named twice, or a chunk that is
        empty or would pass the runner's capacity."""
        seqs = list(range(len(chunks))) if seqs is None else [int(s) for s in seqs]
        starts = [0] * len(chunks) if starts is None else [int(p) for p in starts]
        if len(seqs) != len(chunks) or len(starts) != len(chunks) or len(set(seqs)) != len(seqs):
            raise InvalidInput("seqs and starts must name one distinct slot and position per chunk", field="seqs",
                               value=seqs)
        for s, p, c in zip(seqs, starts, chunks):
            if len(c) == 0:
                raise InvalidInput(f"the chunk for slot {s} is empty", field="chunks", value=s)
            if not 0 <= s < runner.kv.seqs:
                raise InvalidInput(f"slot {s} is outside the runner's {runner.kv.seqs}", field="seqs", value=s)
            if p < 0 or p + len(c) > runner.capacity:
                raise InvalidInput(f"positions {p}..{p + len(c) - 1} pass the runner's capacity {runner.capacity}",
                                   field="starts", value=p)
        return self._prefill(chunks, runner.kv, seqs, starts)

    @_serialized
    def argmax(self, logits) -> list[int]:
        """Greedy token of each row of device logits."""
        with self.stream:
            return [int(t) for t in self.be.to_host(self.be.xp.argmax(logits, axis=1))]

    # --- passes -------------------------------------------------------------------------------------------
    def _prefill_fresh(self, chunks: list[np.ndarray], all_logits: bool = False):
        runner = self._prefill_runner(chunks, None, list(range(len(chunks))), [0] * len(chunks), all_logits)
        if runner is not None:
            return self._run_prefill_runner(runner, chunks)
        with self.stream:           # zeroed on the compute stream: ordered before the pass's KV writes
            kv = self.new_kv(len(chunks), max(len(c) for c in chunks))
        return self._prefill(chunks, kv, list(range(len(chunks))), [0] * len(chunks), all_logits)

    def _prefill(self, chunks, kv, seqs: list[int], starts: list[int], all_logits: bool = False):
        """Device logits [R, V] (R: every row, or each sequence's last) of packed, eager passes of at most
        `max_prefill_rows` rows: sequences are taken in order, a long one split across passes (each later piece
        attends to the KV its earlier pieces wrote)."""
        if sum(len(c) for c in chunks) <= self.config.max_prefill_rows:
            return self._prefill_pass(chunks, kv, seqs, starts, all_logits)
        kept = [[] for _ in chunks]         # device logits of each sequence, in row order
        for pieces in prefill_passes([len(c) for c in chunks], self.config.max_prefill_rows):
            logits = self._prefill_pass([chunks[i][a:b] for i, a, b in pieces], kv, [seqs[i] for i, _, _ in pieces],
                                        [starts[i] + a for i, a, _ in pieces], all_logits)
            row = 0
            for i, a, b in pieces:
                n = b - a if all_logits else 1
                if all_logits or b == len(chunks[i]):
                    kept[i].append(logits[row:row + n])
                row += n
        return self.be.xp.concatenate([part for parts in kept for part in parts])

    def _prefill_pass(self, chunks, kv, seqs: list[int], starts: list[int], all_logits: bool = False):
        """Device logits [R, V] of one packed pass (R: every row, or each sequence's last): a prefill runner's
        (padded, replayed as a graph) where it may take the pass, else eager."""
        runner = self._prefill_runner(chunks, kv, seqs, starts, all_logits)
        if runner is not None:
            return self._run_prefill_runner(runner, chunks)
        host = host_step(self.args, chunks, starts, seqs, all_logits)
        T = len(host.ids)
        with self.stream:
            inp = StepInputs(self.be, T, self.half)
            inp.fill(host, self.stream)
            rows = None if all_logits else self.be.to_device(host.out_rows)
            self._begin(seqs, chunks, starts, T)
            try:
                logits = self.decoder.run(inp, kv, Workspace(self.be), T, rows, max_len=int(host.pos.max()) + 1)
            finally:
                self.decoder.route_hook = None
            self.experts.after_pass(T)
            return logits

    def _prefill_runner(self, chunks, kv, seqs: list[int], starts: list[int], all_logits: bool):
        """The prefill runner for a pass (`runner.PrefillRunner`; kv None: one with KV of its own), or None where a
        pass cannot take one: not one fresh sequence in slot 0, every row's logits wanted, routes read on the host
        (traces), recurrent layers (padding would pass through their state), experts paged, no graphs, or padded
        rows beyond PREFILL_GRAPH_MAX_ROWS, max_prefill_rows or the KV capacity."""
        if (len(chunks) != 1 or starts != [0] or seqs != [0] or all_logits or self.args.linear_layers
                or not self.experts.resident or self.routes.writer is not None or self.routes.observers
                or self.graph_blocker(1) is not None):
            return None
        rows = prefill_bucket(len(chunks[0]))
        limit = min(PREFILL_GRAPH_MAX_ROWS, self.config.max_prefill_rows, self.config.max_seq_len)
        if rows > (limit if kv is None else min(limit, kv.capacity)):
            return None
        key = (rows, None if kv is None else id(kv), self.be.kernel_choices())
        runner = self._prefill_runners.pop(key, None)     # re-inserted last: the dict keeps recency order
        if runner is None:
            with self.stream:       # its KV zeroed on the compute stream, before any pass writes it
                runner = PrefillRunner(self, rows, kv)
        self._prefill_runners[key] = runner
        while len(self._prefill_runners) > PREFILL_GRAPHS_KEPT:
            del self._prefill_runners[next(iter(self._prefill_runners))]
        return runner

    def _run_prefill_runner(self, runner: PrefillRunner, chunks):
        T = len(chunks[0])
        with self.stream:
            self._begin([0], chunks, [0], T)
            logits = runner.run(np.asarray(chunks[0]))
            self.experts.after_pass(T)
            return logits

    def _begin(self, seqs, chunks, starts, rows: int) -> None:
        """Bookkeeping of one pass: trace rows, the expert cache's token clock, the route hook if routes are read."""
        if self.closed:
            raise InvalidInput("the engine is closed", field="engine")
        self.routes.begin(self._step, seqs, chunks, starts)
        self._step += 1
        if rows:
            self.experts.begin_token(rows)      # a decode runner's step advances the clock itself
        if self.routes.writer is not None or self.routes.observers:
            self.decoder.route_hook = lambda layer, ids: self.routes.record(layer,
                                                                            self.be.to_host(ids).astype(np.int64))

    def _decode(self, prompt, max_new_tokens, pick: Sampler, stop, stop_text: StopStrings | None, callback,
                stats) -> list[int]:
        out: list[int] = []
        budget = min(max_new_tokens, self.config.max_seq_len - len(prompt))
        stats.finish_reason = "length" if budget == max_new_tokens else "max_seq_len"
        if budget <= 0:
            return out
        runner = self.decode_runner(1, len(prompt) + budget)
        t0 = time.perf_counter()
        row = self.be.to_host(self._prefill([prompt], runner.kv, [0], [0]))[0]
        t1 = time.perf_counter()
        for token in self._tokens(runner, row, len(prompt), budget, pick):
            out.append(token)
            if out[-1] in stop or (stop_text is not None and stop_text.reached(out)):
                stats.finish_reason = "stop"
                break
            if callback is not None and callback(out[-1]) is False:
                stats.finish_reason = "callback"
                break
        stats.prefill_seconds, stats.decode_seconds = t1 - t0, time.perf_counter() - t1
        stats.generated_tokens = len(out)
        return out

    def _tokens(self, runner: DecodeRunner, row: np.ndarray, length: int, budget: int, pick: Sampler):
        """The `budget` tokens of one sequence of `length` tokens in `runner`, picked one at a time from the prefill's
        logits `row` on: greedy ones in chains of `chain_steps` steps fed on the device (a stop found inside a
        chain drops the rest of it), sampled ones a step at a time through the host."""
        token = pick(row)
        yield token
        step = 1
        while step < budget:
            if pick.greedy:
                n = min(self.chain_steps, budget - step)
                for t in self._chain(runner, np.array([token]), np.array([length + step - 1]), n)[:, 0]:
                    token = pick.picked(t)
                    yield token
                step += n
            else:
                token = pick(self._decode_step(runner, token, length + step - 1))
                yield token
                step += 1

    def _chain(self, runner: DecodeRunner, last: np.ndarray, pos: np.ndarray, steps: int) -> np.ndarray:
        """`runner.chain` with the engine's bookkeeping before each step (traces, route hook)."""
        seqs = list(range(runner.batch))
        one = [np.zeros(1, np.int32)] * runner.batch

        def begin(j: int) -> None:
            self._begin(seqs, one, [int(p) + j for p in pos], rows=0)
        try:
            return runner.chain(last, pos, steps, before_step=begin)
        finally:
            self.decoder.route_hook = None

    def _decode_step(self, runner: DecodeRunner, token: int, pos: int) -> np.ndarray:
        self._begin([0], [np.array([token])], [pos], rows=0)
        try:
            return self.be.to_host(runner.step(np.array([token]), np.array([pos])))[0]
        finally:
            self.decoder.route_hook = None

    def _counts(self) -> tuple:
        self.experts.flush()
        c = self.experts.counters
        return c.hits, c.misses, c.loads, c.bytes_paged, set(c.touched), c.stall_seconds, c.bytes_zero_copy

    def _finish_stats(self, stats: GenerationStats, c0: tuple) -> None:
        self.experts.flush()
        c = self.experts.counters
        stats.cache_hits, stats.cache_misses = c.hits - c0[0], c.misses - c0[1]
        stats.bytes_zero_copy = c.bytes_zero_copy - c0[6]
        stats.expert_loads, stats.bytes_paged = c.loads - c0[2], c.bytes_paged - c0[3]
        stats.experts_touched = len(c.touched - c0[4])
        stats.stall_seconds = c.stall_seconds - c0[5]
        stats.set_rates()

    # --- inputs -----------------------------------------------------------------------------------------
    def _check(self, batch) -> list[np.ndarray]:
        if self.closed:
            raise InvalidInput("the engine is closed", field="engine")
        return check_batch(batch, self.vocab_size, self.config.max_batch_size, self.config.max_seq_len)

    def _prompt(self, prompt: Sequence[int] | str) -> np.ndarray:
        if self.closed:
            raise InvalidInput("the engine is closed", field="engine")
        return prompt_ids(prompt, self.tokenizer, self.vocab_size, self.config.max_seq_len)

    def _stop_ids(self) -> list[int]:
        return self.tokenizer.stop_ids if self.tokenizer is not None else []

    # --- lifetime ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the file and device memory; waits for a call in flight on another thread."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.routes.close()
        self._runners.clear()
        self._prefill_runners.clear()
        self.experts.close()
        self.dense = self.decoder = None
        self.reader.close()
        self.be.release_stream(self.stream)     # last: whatever it meets, the file and the pool are released

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# --- the C-style names of the original project ----------------------------------------------------------

def colibri_init(path: str | os.PathLike, config: EngineConfig | None = None,
                 **fields: Any) -> Engine:
    """Open an engine; `fields` (device_id=, max_batch_size=, ...) build an EngineConfig when none is given."""
    return Engine(path, config or EngineConfig(**fields))


def colibri_infer(engine: Engine, batch: Sequence[Sequence[int]]) -> list[int]:
    return engine.infer(batch)


def colibri_free(engine: Engine) -> None:
    engine.close()

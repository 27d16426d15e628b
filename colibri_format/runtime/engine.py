"""The NumPy reference engine: batched prefill, incremental decoding through a KV cache, experts paged lazily.

    with Engine("model.colibri", EngineConfig(max_cached_experts=64)) as eng:
        eng.infer([[1, 2, 3], [4, 5]])                   # next token id per sequence
        eng.generate([1, 2, 3], max_new_tokens=32)       # GenerationResult(output_ids, text, stats)

`colibri_init` / `colibri_infer` / `colibri_free` are the C-style names users know from the original project.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from colibri_format.errors import InvalidInput
from colibri_format.runtime.expert_source import CachedExperts, DictExpertCache, PagingStats
from colibri_format.runtime.inputs import check_batch, prompt_ids
from colibri_format.runtime.model import MoEModel
from colibri_format.runtime.sampling import check_sampling, sample
from colibri_format.runtime.weights import FileWeights, WeightProvider

RouteObserver = Callable[[int, int, int, np.ndarray, int], None]  # (step, seq, layer, experts [P, k], pos0)


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"                       # "cpu" (this engine) or "cuda" (the CuPy engine)
    device_id: int = 0
    max_batch_size: int = 32
    max_seq_len: int = 2048
    max_cached_experts: int | None = None     # None: keep every expert once loaded
    use_async_memcpy: bool = True             # CUDA engine only
    verbose: bool = False
    cache_policy: str = "lrfu"                # lru | lfu | lrfu | static | random
    cache_scope: str = "global"               # global | per_layer
    decay_factor: float = 0.999
    cache_clock: str = "access"               # LRFU clock: per expert access (design) or per token
    cache_history: bool = True                # lfu/lrfu keep an evicted expert's count (best online policy
                                              # on the demo model's real traces, docs/cache.md)
    verify: str = "first-use"                 # never | first-use | always (expert and tensor checksums)
    trace_path: str | None = None             # write a routing trace (JSON Lines) here
    pinned_experts: tuple | None = None       # (layer, expert) pairs for cache_policy="static"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{name} must be a positive integer", field=name, value=value)
        if self.device not in ("cpu", "cuda"):
            raise InvalidInput("device must be 'cpu' or 'cuda'", field="device", value=self.device)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    experts_touched: int = 0                  # distinct (layer, expert) pairs the router picked
    cache_hits: int = 0
    cache_misses: int = 0
    expert_loads: int = 0
    bytes_paged: int = 0
    stall_seconds: float = 0.0                # CUDA engine: compute idle, waiting for expert copies
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
        d["hit_rate"] = self.cache_hits / accesses if accesses else 0.0
        d["misses_per_token"] = self.cache_misses / tokens if tokens else 0.0
        d["paged_gb_per_s"] = self.bytes_paged / seconds / 1e9 if seconds else 0.0
        d["stall_ms_per_token"] = 1e3 * self.stall_seconds / tokens if tokens else 0.0
        return d


@dataclass
class GenerationResult:
    output_ids: list[int]
    text: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)


def _make_cache(config: EngineConfig):
    try:
        from colibri_format.runtime.cache.expert_cache import ExpertCache
    except ImportError:  # a checkout without the cache module: plain LRU, same counters
        return DictExpertCache(config.max_cached_experts)

    pinned = [tuple(p) for p in config.pinned_experts] if config.pinned_experts is not None else None
    return ExpertCache(config.max_cached_experts, policy=config.cache_policy, scope=config.cache_scope,
                       decay=config.decay_factor, clock=config.cache_clock, pinned=pinned,
                       history=config.cache_history and config.cache_policy in ("lfu", "lrfu"))


def _cache_counts(cache) -> tuple[int, int]:
    if hasattr(cache, "stats"):
        s = cache.stats()
        return s.hits, s.misses
    return cache.hits, cache.misses


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


class Engine:
    def __new__(cls, source: Any = None, config: EngineConfig | None = None):
        if config is not None and config.device == "cuda" and cls is Engine:
            return _cuda_engine(source, config)   # same API, GPU kernels; __init__ below is skipped
        return super().__new__(cls)

    def __init__(self, source: str | os.PathLike | WeightProvider, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        owns = isinstance(source, (str, os.PathLike))
        self.weights = FileWeights.open(os.fspath(source), self.config.verify) if owns else source
        self._owns_weights = owns
        self.cache = _make_cache(self.config)
        self.experts = CachedExperts(self.weights, self.cache)
        self.routes = _RouteLog(self.weights.model, self.config.trace_path,
                                str(self.weights.metadata.get("architecture", "unknown")))
        self.model = MoEModel(self.weights.model, self.weights.dense, self.experts, self.weights.has,
                              self.routes.record)
        self._tokenizer: Any = None
        self._step = 0
        self.closed = False

    # --- properties -------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def tokenizer(self):
        """The file's embedded tokenizer, or None when the file has none."""
        if self._tokenizer is None:
            from colibri_format.runtime.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_metadata(self.weights.metadata) or False
        return self._tokenizer or None

    # --- inference --------------------------------------------------------------------------------------

    def logits(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Logits of every position, [n_i, vocab] float32 per sequence (a fresh KV cache for each)."""
        chunks = self._check(batch)
        return self._forward(chunks, [self.model.new_cache() for _ in chunks], all_logits=True)

    def infer(self, batch: Sequence[Sequence[int]]) -> list[int]:
        """Greedy next token id per sequence after a batched prefill."""
        chunks = self._check(batch)
        last = self._forward(chunks, [self.model.new_cache() for _ in chunks])
        return [int(np.argmax(row)) for row in last]

    def generate(self, prompt_ids: Sequence[int] | str, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_ids: Sequence[int] | None = None,
                 callback: Callable[[int], Any] | None = None) -> GenerationResult:
        """Prefill the prompt, then decode one token per step; `callback(token_id)` returning False stops."""
        prompt = self._prompt(prompt_ids)
        check_sampling(temperature, top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidInput("max_new_tokens must be an integer >= 0", field="max_new_tokens", value=max_new_tokens)
        stop = set(self._stop_ids() if stop_ids is None else stop_ids)
        self.experts.stats, counts0 = PagingStats(), _cache_counts(self.cache)
        stats = GenerationStats(prompt_tokens=len(prompt))
        out = self._decode(prompt, max_new_tokens, temperature, top_p, seed, stop, callback, stats)
        self._finish_stats(stats, counts0)
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        if self.config.verbose:
            print(f"colibri: {stats.as_dict()}", file=sys.stderr)
        return GenerationResult(out, text, stats)

    def _decode(self, prompt, max_new_tokens, temperature, top_p, seed, stop, callback, stats) -> list[int]:
        rng, cache, out = np.random.default_rng(seed), self.model.new_cache(), []
        budget = min(max_new_tokens, self.config.max_seq_len - len(prompt))
        stats.finish_reason = "length" if budget == max_new_tokens else "max_seq_len"
        if budget <= 0:
            return out
        t0 = time.perf_counter()
        logits = self._forward([prompt], [cache])[0]
        t1 = time.perf_counter()
        for step in range(budget):
            if step:
                logits = self._forward([np.array([out[-1]])], [cache])[0]
            out.append(sample(logits, temperature, top_p, rng))
            halted = callback is not None and callback(out[-1]) is False    # the callback sees every token
            if out[-1] in stop or halted:
                stats.finish_reason = "stop" if out[-1] in stop else "callback"
                break
        stats.prefill_seconds, stats.decode_seconds = t1 - t0, time.perf_counter() - t1
        stats.generated_tokens = len(out)
        return out

    def _finish_stats(self, stats: GenerationStats, counts0: tuple[int, int]) -> None:
        hits, misses = _cache_counts(self.cache)
        paging = self.experts.stats
        stats.cache_hits, stats.cache_misses = hits - counts0[0], misses - counts0[1]
        stats.experts_touched, stats.expert_loads, stats.bytes_paged = (len(paging.touched), paging.loads,
                                                                        paging.bytes_paged)
        stats.set_rates()

    def _forward(self, chunks: list[np.ndarray], caches, all_logits: bool = False, seqs=None) -> list[np.ndarray]:
        if self.closed:
            raise InvalidInput("the engine is closed", field="engine")
        self.routes.begin(self._step, seqs or range(len(chunks)), chunks, [c.length for c in caches])
        if hasattr(self.cache, "begin_token"):
            self.cache.begin_token()
        out = self.model.forward(chunks, caches, all_logits)
        self._step += 1
        return out

    # --- inputs -----------------------------------------------------------------------------------------

    def _check(self, batch) -> list[np.ndarray]:
        return check_batch(batch, self.vocab_size, self.config.max_batch_size, self.config.max_seq_len)

    def _prompt(self, prompt: Sequence[int] | str) -> np.ndarray:
        return prompt_ids(prompt, self.tokenizer, self.vocab_size, self.config.max_seq_len)

    def _stop_ids(self) -> list[int]:
        return self.tokenizer.stop_ids if self.tokenizer is not None else []

    # --- lifetime ---------------------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.routes.close()
        if self._owns_weights:
            self.weights.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _cuda_engine(source: Any, config: EngineConfig):
    try:
        from colibri_format.runtime.cuda.engine_cuda import CudaEngine
    except ImportError as exc:
        raise InvalidInput(f"device='cuda' needs CuPy and the CUDA engine ({exc})", field="device",
                           value="cuda") from None
    return CudaEngine(source, config)


# --- the C-style names of the original project ----------------------------------------------------------

def colibri_init(path: str | os.PathLike | WeightProvider, config: EngineConfig | None = None,
                 **fields: Any) -> Engine:
    """Open an engine; `fields` (device_id=, max_batch_size=, ...) build an EngineConfig when none is given."""
    return Engine(path, config or EngineConfig(**fields))


def colibri_infer(engine: Engine, batch: Sequence[Sequence[int]]) -> list[int]:
    return engine.infer(batch)


def colibri_free(engine: Engine) -> None:
    engine.close()

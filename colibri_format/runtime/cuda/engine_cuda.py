"""The CUDA engine: the NumPy `Engine`'s API and results, computed with the kernels of `runtime/kernels`.

    with Engine("model.colibri", EngineConfig(device="cuda")) as eng:    # Engine hands over to CudaEngine
        eng.generate([1, 2, 3], max_new_tokens=32)

Dense weights are uploaded once, as stored. Experts live in a fixed device pool (cuda_experts.py): all resident
when they fit in `max_cached_experts` (or it is None), else paged from the file mapping through the shared
`ExpertCache`. Prefill runs eagerly (cuBLAS for the dense products); each decode step with all experts resident
is captured once as a CUDA graph and replayed (static input and output buffers), with eager execution and a
stated reason (`stats()["graph"]`) when a step cannot be captured. CuPy is imported only by cuda_backend.py.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from colibri_format.errors import InvalidInput
from colibri_format.runtime.cuda.backend import make_backend
from colibri_format.runtime.cuda.dense import GEMV_MAX_ROWS, DeviceDense
from colibri_format.runtime.cuda.pager import ExpertPool
from colibri_format.runtime.cuda.forward_cuda import (DeviceForward, HostStep, KVBuffers, StepInputs, Workspace,
                                               host_step, rope_rows)
from colibri_format.runtime.engine import (EngineConfig, GenerationResult, GenerationStats, _make_cache,
                                           _RouteLog)
from colibri_format.runtime.inputs import check_batch, prompt_ids
from colibri_format.runtime.model import ModelArgs
from colibri_format.runtime.rope import rotary_dim
from colibri_format.runtime.sampling import check_sampling, sample

MAX_RUNNERS = 2   # decode graphs kept (each holds a KV cache for its batch size and capacity)


def _cache_factory(config: EngineConfig):
    def make(on_evict):
        cache = _make_cache(config)
        cache.on_evict = on_evict
        return cache
    return make


def _capacity_for(length: int, max_seq_len: int) -> int:
    """KV capacity: the next power of two (at least 64) so that repeated calls reuse one decode graph."""
    cap = 64
    while cap < length:
        cap *= 2
    return min(cap, max_seq_len)


class DecodeRunner:
    """One decode step for B sequences over its own KV cache: eager once, then a captured graph replayed."""

    def __init__(self, eng: "CudaEngine", batch: int, capacity: int) -> None:
        a, xp = eng.args, eng.be.xp
        self.eng, self.batch, self.capacity = eng, batch, capacity
        self.kv = KVBuffers(xp, a.num_layers, batch, capacity, a.n_kv_heads, a.head_dim)
        self.ws = Workspace(xp, batch)
        self.inp = StepInputs(eng.be, batch, eng.half)
        self.graph = None
        self.eager_steps = 0
        self.reason = eng.graph_blocker(batch)

    def step(self, ids: np.ndarray, pos: np.ndarray):
        """Logits [B, V] (a device buffer overwritten by the next step) after one token per sequence."""
        with self.eng.stream:
            return self._step(ids, pos)

    def _step(self, ids: np.ndarray, pos: np.ndarray):
        eng, B = self.eng, self.batch
        cos, sin = rope_rows(eng.args, [np.array([p]) for p in pos])
        host = HostStep(np.asarray(ids, np.int32), np.asarray(pos, np.int32), np.arange(B, dtype=np.int32),
                        cos, sin, np.arange(B, dtype=np.int32))
        self.inp.fill(host, eng.stream)
        eng.experts.begin_token(B)
        if self.graph is not None:
            eng.be.launch(self.graph, eng.stream)
            return self.ws.buf("logits", (B, eng.args.vocab_size))
        logits = eng.fwd.run(self.inp, self.kv, self.ws, B, None, max_len=self.capacity, host=host)
        self.eager_steps += 1
        if self.reason is None and eng.fwd.route_hook is None:
            self._capture(host)
        return logits

    def _capture(self, host: HostStep) -> None:
        eng = self.eng
        self.ws.frozen = True
        try:
            self.graph = eng.be.capture(eng.stream, lambda: eng.fwd.run(self.inp, self.kv, self.ws, self.batch,
                                                                         None, max_len=self.capacity, host=host))
        except Exception as exc:  # noqa: BLE001 -- any capture failure: stay eager, say why
            self.graph = None
            self.reason = f"capture failed: {type(exc).__name__}: {exc}"
        finally:
            self.ws.frozen = False


class CudaEngine:
    """Same public API as `runtime.engine.Engine` (infer, logits, generate, close, context manager)."""

    def __init__(self, source: str | os.PathLike, config: EngineConfig | None = None, *, use_graphs: bool = True,
                 prefetch: bool = False) -> None:
        self.config = config or EngineConfig(device="cuda")
        if not isinstance(source, (str, os.PathLike)):
            raise InvalidInput("the CUDA engine reads a .colibri file path (experts are copied from its mapping)",
                               field="source", value=type(source).__name__)
        import colibri_format  # late: the package imports the runtime's siblings

        self.closed = True
        self.reader = colibri_format.open(os.fspath(source), verify=self.config.verify)
        try:
            self._setup(use_graphs, prefetch)
        except BaseException:
            self.reader.close()
            raise
        self.closed = False

    def _setup(self, use_graphs: bool, prefetch: bool) -> None:
        cfg = self.config
        self.metadata = self.reader.metadata
        self.args = ModelArgs.from_dict(self.reader.model)
        self.half = rotary_dim(self.args.rope, self.args.head_dim) // 2
        self.be = make_backend(cfg.device_id)
        self.stream = self.be.new_stream()
        self.be.host_stream = self.stream
        t0 = time.perf_counter()
        with self.stream:
            self.dense = DeviceDense(self.reader, self.be)
            self.experts = ExpertPool(self.reader, self.args, cfg, self.be, self.dense, self.stream,
                                      _cache_factory(cfg), prefetch=prefetch)
        self.be.synchronize()        # uploads made outside the compute stream are done before it runs
        self.load_seconds = time.perf_counter() - t0
        self.cache = self.experts.cache
        self.fwd = DeviceForward(self.args, self.dense, self.experts, self.be)
        self.routes = _RouteLog(self.reader.model, cfg.trace_path,
                                str(self.metadata.get("architecture", "unknown")))
        self.use_graphs = use_graphs
        self._runners: dict[tuple[int, int], DecodeRunner] = {}
        self._tokenizer: Any = None
        self._step = 0

    # --- properties -------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from colibri_format.runtime.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_metadata(self.metadata) or False
        return self._tokenizer or None

    def graph_blocker(self, batch: int) -> str | None:
        """Why a decode step of `batch` rows cannot be captured, or None."""
        if not self.use_graphs:
            return "graphs disabled"
        if not self.experts.resident:
            return "experts are paged: routing must reach the host every layer"
        if self.experts.forced_routes is not None:
            return "routing is replayed from the host (benchmark)"
        if not self.fwd.fast_attention:
            return f"head_dim {self.args.head_dim} uses the array-operation attention fallback"
        if batch > GEMV_MAX_ROWS:
            return f"batch {batch} > {GEMV_MAX_ROWS} uses cuBLAS, which cannot be captured"
        return None

    def stats(self) -> dict:
        """Engine-level state: expert residency and paging counters, graph status, memory."""
        graphs = {f"{b}x{c}": ("captured" if r.graph is not None else r.reason)
                  for (b, c), r in self._runners.items()}
        ex = self.experts
        out = {"resident": ex.resident, "slots": ex.slots, "blob_bytes": ex.blob_size,
               "expert_bytes_on_device": ex.bytes_on_device, "dense_bytes": self.dense.nbytes,
               "host_source": ex.source.mode, "host_source_note": ex.source.reason,
               "load_seconds": self.load_seconds, "graphs": graphs, "paging": ex.counters.as_dict()}
        if self.cache is not None:
            s = self.cache.stats()
            out["cache"] = {"hits": s.hits, "misses": s.misses, "evictions": s.evictions, "hit_rate": s.hit_rate}
        return out

    # --- inference --------------------------------------------------------------------------------------
    def logits(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Logits of every position, [n_i, vocab] float32 per sequence (a fresh KV cache for each)."""
        chunks = self._check(batch)
        out = self.be.to_host(self._prefill_fresh(chunks, all_logits=True))
        sizes = np.cumsum([len(c) for c in chunks])[:-1]
        return list(np.split(out, sizes))

    def infer(self, batch: Sequence[Sequence[int]]) -> list[int]:
        """Greedy next token id per sequence after a batched prefill."""
        chunks = self._check(batch)
        last = self.be.to_host(self._prefill_fresh(chunks))
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
        c0 = self._counts()
        stats = GenerationStats(prompt_tokens=len(prompt))
        out = self._decode(prompt, max_new_tokens, temperature, top_p, seed, stop, callback, stats)
        self._finish_stats(stats, c0)
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        if self.config.verbose:
            print(f"colibri(cuda): {stats.as_dict()}", file=sys.stderr)
        return GenerationResult(out, text, stats)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding of several prompts at once (one decode graph for the batch); token ids per prompt."""
        chunks = self._check(prompts)
        need = max(len(c) for c in chunks) + max_new_tokens
        if need > self.config.max_seq_len:
            raise InvalidInput(f"prompt + max_new_tokens = {need} exceeds max_seq_len={self.config.max_seq_len}",
                               field="max_new_tokens", value=max_new_tokens)
        runner = self._runner(len(chunks), _capacity_for(need, self.config.max_seq_len))
        logits = self._prefill(chunks, runner.kv, list(range(len(chunks))), [0] * len(chunks))
        outs = [[t] for t in self._argmax(logits)]
        pos = np.array([len(c) for c in chunks])
        for _ in range(max_new_tokens - 1):
            logits = runner.step(np.array([o[-1] for o in outs]), pos)
            for o, t in zip(outs, self._argmax(logits)):
                o.append(t)
            pos = pos + 1
        return outs

    def _argmax(self, logits) -> list[int]:
        with self.stream:
            return [int(t) for t in self.be.to_host(self.be.xp.argmax(logits, axis=1))]

    # --- passes -------------------------------------------------------------------------------------------
    def _prefill_fresh(self, chunks: list[np.ndarray], all_logits: bool = False):
        with self.stream:           # zeroed on the compute stream: ordered before the pass's KV writes
            kv = KVBuffers(self.be.xp, self.args.num_layers, len(chunks), max(len(c) for c in chunks),
                           self.args.n_kv_heads, self.args.head_dim)
        return self._prefill(chunks, kv, list(range(len(chunks))), [0] * len(chunks), all_logits)

    def _prefill(self, chunks, kv, seqs: list[int], starts: list[int], all_logits: bool = False):
        """Device logits [R, V] of a packed, eager pass (R: every row, or each sequence's last)."""
        if self.closed:
            raise InvalidInput("the engine is closed", field="engine")
        host = host_step(self.args, chunks, starts, seqs, all_logits)
        T = len(host.ids)
        with self.stream:
            inp = StepInputs(self.be, T, self.half)
            inp.fill(host, self.stream)
            rows = None if all_logits else self.be.to_device(host.out_rows)
            self._begin(seqs, chunks, starts, T)
            try:
                return self.fwd.run(inp, kv, Workspace(self.be.xp, T), T, rows,
                                    max_len=int(host.pos.max()) + 1, host=host)
            finally:
                self.fwd.route_hook = None

    def _begin(self, seqs, chunks, starts, rows: int) -> None:
        self.routes.begin(self._step, seqs, chunks, starts)
        self._step += 1
        self.experts.begin_token(rows)
        if self.routes.writer is not None or self.routes.observers:
            self.fwd.route_hook = lambda layer, ids: self.routes.record(layer, self.be.to_host(ids).astype(np.int64))

    def _runner(self, batch: int, capacity: int) -> DecodeRunner:
        key = (batch, capacity)
        if key not in self._runners:
            while len(self._runners) >= MAX_RUNNERS:
                self._runners.pop(next(iter(self._runners)))
            with self.stream:
                self._runners[key] = DecodeRunner(self, batch, capacity)
        return self._runners[key]

    def _decode(self, prompt, max_new_tokens, temperature, top_p, seed, stop, callback, stats) -> list[int]:
        rng, out = np.random.default_rng(seed), []
        budget = min(max_new_tokens, self.config.max_seq_len - len(prompt))
        stats.finish_reason = "length" if budget == max_new_tokens else "max_seq_len"
        if budget <= 0:
            return out
        runner = self._runner(1, _capacity_for(len(prompt) + budget, self.config.max_seq_len))
        t0 = time.perf_counter()
        logits = self._prefill([prompt], runner.kv, [0], [0])
        row = self.be.to_host(logits)[0]
        t1 = time.perf_counter()
        for step in range(budget):
            if step:
                row = self._decode_step(runner, out[-1], len(prompt) + step - 1)
            out.append(sample(row, temperature, top_p, rng))
            if out[-1] in stop or (callback is not None and callback(out[-1]) is False):
                stats.finish_reason = "stop" if out[-1] in stop else "callback"
                break
        stats.prefill_seconds, stats.decode_seconds = t1 - t0, time.perf_counter() - t1
        stats.generated_tokens = len(out)
        return out

    def _decode_step(self, runner: DecodeRunner, token: int, pos: int) -> np.ndarray:
        if self.closed:
            raise InvalidInput("the engine is closed", field="engine")
        chunk = np.array([token])
        with self.stream:
            self._begin_decode(chunk, pos)
            try:
                logits = runner.step(chunk, np.array([pos]))
                return self.be.to_host(logits)[0]
            finally:
                self.fwd.route_hook = None

    def _begin_decode(self, chunk, pos: int) -> None:
        self.routes.begin(self._step, [0], [chunk], [pos])
        self._step += 1       # the runner's step advances the expert cache's token clock
        if self.routes.writer is not None or self.routes.observers:
            self.fwd.route_hook = lambda layer, ids: self.routes.record(layer, self.be.to_host(ids).astype(np.int64))

    def _counts(self) -> tuple:
        c = self.experts.counters
        return c.hits, c.misses, c.loads, c.bytes_paged, set(c.touched), c.stall_seconds

    def _finish_stats(self, stats: GenerationStats, c0: tuple) -> None:
        c = self.experts.counters
        stats.cache_hits, stats.cache_misses = c.hits - c0[0], c.misses - c0[1]
        stats.expert_loads, stats.bytes_paged = c.loads - c0[2], c.bytes_paged - c0[3]
        stats.experts_touched = len(c.touched - c0[4]) if not self.experts.resident else 0
        stats.stall_seconds = c.stall_seconds - c0[5]
        stats.set_rates()

    # --- inputs -----------------------------------------------------------------------------------------
    def _check(self, batch) -> list[np.ndarray]:
        if self.closed:
            raise InvalidInput("the engine is closed", field="engine")
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
        self._runners.clear()
        self.experts.close()
        self.dense = None
        self.reader.close()

    def __enter__(self) -> "CudaEngine":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

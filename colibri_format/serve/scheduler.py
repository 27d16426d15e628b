"""Continuous batching over one engine: one thread owns the engine, the KV buffers (and recurrent states) of
`max_batch_size` slots, and decode runners of 1, 2, 4, ... rows over them (batch buckets).

    sched = Scheduler("model.colibri", EngineConfig(max_batch_size=8), max_queue=64).start()
    job = Job(prompt_ids, SamplingParams(max_tokens=32), sink=events.append)
    sched.submit(job)            # QueueFull beyond max_queue waiting requests
    sched.cancel(job)            # its slot is free before the next step

Each turn of the loop: drop cancelled requests (their slots free at once), prefill waiting requests into the
lowest free slots (up to `prefill_tokens` prompt tokens a turn, one packed pass, each from position 0 of its own
slot), compact the slots, then one decode step for every running request. A finished request leaves its slot at
once, so a waiting one joins at the next turn. The engine, its tokenizer decoding, the samplers and the stop checks
all run on this thread; a request's `sink` gets its events from here (the app forwards them to the event loop).

Compaction keeps the running requests in slots 0..n-1: while a free slot lies below a running request, the highest
running request moves down into it (`KVBuffers.move`: its KV rows up to its position in every layer, and its
recurrent state). So a step costs what n requests need, not what `max_batch_size` slots would.

Two decode steps, the same tokens:
- `packed` (the NumPy backend, and CUDA without graphs): one eager pass over the running requests' last tokens
  only, each at its own position of its own slot (`Engine.prefill_into` with `seqs` and `starts`).
- `runner` (CUDA with graphs): the fixed-shape step of the smallest bucket runner (1, 2, 4, ... rows, and
  `max_batch_size`) that holds slots 0..n-1, each bucket's step captured as a CUDA graph on its first use and
  replayed after (a bucket the backend cannot capture, e.g. over the GEMV row limit, runs eagerly). The rows of
  free slots inside the bucket repeat the first running request's token and position: they write only their own KV
  rows (a slot's rows beyond its sequence are never read, and a prefill rewrites them from position 0) and route to
  experts already needed, so they neither disturb running requests nor page in experts.
Greedy requests are picked by one argmax on the device; others by their own seeded `Sampler` on the host.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from colibri_format.errors import ColibriFormatError, InvalidInput
from colibri_format.runtime.engine import Engine, EngineConfig
from colibri_format.runtime.infer import TextStream
from colibri_format.runtime.sampling import Sampler, find_stop

from .metrics import Metrics

log = logging.getLogger("colibri.serve")

DECODE_MODES = ("auto", "packed", "runner")
STATS_INTERVAL = 1.0          # seconds between engine.stats() snapshots for /metrics


def batch_buckets(max_batch_size: int) -> list[int]:
    """The decode runners' row counts: powers of two below `max_batch_size`, then `max_batch_size`."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


class QueueFull(Exception):
    """The waiting queue holds max_queue requests already (the app answers 429)."""


class SchedulerClosed(Exception):
    """The scheduler stopped (shut down, or its engine failed); the app answers 503."""


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for, checked by the protocol layer (runtime/sampling.py ranges)."""
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()            # stop strings: the text ends before the first one
    stop_ids: tuple[int, ...] = ()        # stop tokens: generated (counted), not shown

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 and self.repetition_penalty == 1.0


# Events a job's sink receives, in order: Delta* then exactly one of Done / Failed.
@dataclass
class Delta:
    text: str                             # text released by this token (may be empty: held back)
    token_ids: list[int]


@dataclass
class Done:
    finish_reason: str                    # stop | length | cancelled
    text: str                             # the whole output text (cut at a stop string)
    tail: str                             # text not yet sent in a Delta
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str
    status: int = 500


_ids = itertools.count()


@dataclass(eq=False)
class Job:
    """One request inside the scheduler."""
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Any], None]
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    finished: bool = False
    slot: int = -1
    pos: int = 0                          # position of `out[-1]` (the next step's input)
    out: list[int] = field(default_factory=list)
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    sampler: Sampler | None = None
    stream: TextStream | None = None
    _pieces: list[str] = field(default_factory=list)


class Scheduler:
    """The serving loop over `Engine(path, config)`; see the module docstring."""

    def __init__(self, path: str, config: EngineConfig, *, max_queue: int = 64, prefill_tokens: int = 2048,
                 decode: str = "auto", metrics: Metrics | None = None) -> None:
        if decode not in DECODE_MODES:
            raise InvalidInput(f"decode must be one of {', '.join(DECODE_MODES)}", field="decode", value=decode)
        for name, value in (("max_queue", max_queue), ("prefill_tokens", prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_queue" else 1):
                raise InvalidInput(f"{name} must be a{' non-negative' if name == 'max_queue' else ' positive'} "
                                   "integer", field=name, value=value)
        self.path, self.config = str(path), config
        self.max_batch_size, self.max_seq_len = config.max_batch_size, config.max_seq_len
        self.max_queue, self.prefill_tokens, self.decode_mode = max_queue, prefill_tokens, decode
        self.metrics = metrics or Metrics()
        self.metrics.max_batch_size, self.metrics.max_queue = self.max_batch_size, max_queue
        self.slots: list[Job | None] = [None] * self.max_batch_size
        self.waiting: collections.deque[Job] = collections.deque()
        self.cv = threading.Condition()
        self.error: BaseException | None = None      # what stopped the loop, if anything did
        self.tokenizer: Any = None
        self.vocab_size = 0
        self.backend = ""
        self._stopping = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="colibri-scheduler", daemon=True)
        self._engine: Engine | None = None
        self.buckets = batch_buckets(self.max_batch_size)
        self._runners: dict[int, Any] = {}            # bucket -> DecodeRunner over the shared KV buffers (lazy)
        self._kv: Any = None                          # the KV buffers (and recurrent states) of every slot
        self._stats_at = 0.0

    # --- lifetime (any thread) ----------------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        """Open the engine on the scheduler thread and wait until it is ready; re-raises what opening raised."""
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            self._thread.join()
            raise self.error
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the loop: requests still waiting or running fail with 503; the engine is closed."""
        with self.cv:
            self._stopping = True
            self.cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> "Scheduler":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.error is None

    # --- requests (any thread) ----------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFull when max_queue requests already wait beyond the free slots, SchedulerClosed when
        the loop is down."""
        with self.cv:
            if not self.alive:
                raise SchedulerClosed("the server is shutting down" if self._stopping else "the engine failed")
            if len(self.waiting) >= self.max_queue + self.slots.count(None):
                self.metrics.count("rejected_queue_full")
                raise QueueFull(f"{len(self.waiting)} requests wait for a slot already (max_queue={self.max_queue})")
            self.waiting.append(job)
            self.metrics.queue_depth = len(self.waiting)
            self.cv.notify_all()

    def cancel(self, job: Job) -> None:
        """The client is gone: a waiting job leaves the queue now, a running one its slot before the next step."""
        with self.cv:
            if job.finished:
                return
            job.cancelled = True
            try:
                self.waiting.remove(job)
            except ValueError:
                pass
            else:
                job.finished = True
                self.metrics.count("cancelled")
                self.metrics.queue_depth = len(self.waiting)
            self.cv.notify_all()

    @property
    def running(self) -> int:
        return sum(job is not None for job in self.slots)

    # --- the loop (scheduler thread) ----------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._open()
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - every request fails with the reason, the health check says so
            log.exception("the serving loop stopped")
            self.error = exc
        finally:
            reason = "the server is shutting down" if self.error is None else \
                f"the engine failed: {type(self.error).__name__}: {self.error}"
            with self.cv:
                self._stopping = True
                jobs = [j for j in self.slots if j is not None] + list(self.waiting)
                self.waiting.clear()
                self.slots = [None] * self.max_batch_size
            for job in jobs:
                self._fail(job, reason, 503)
            self._runners, self._kv = {}, None
            self._engine.close()

    def _open(self) -> None:
        eng = self._engine = Engine(self.path, self.config)
        try:
            self.tokenizer, self.vocab_size, self.backend = eng.tokenizer, eng.vocab_size, eng.be.name
            top = eng.decode_runner(self.max_batch_size, self.max_seq_len)     # owns the KV buffers of all slots
            self._runners, self._kv = {self.max_batch_size: top}, top.kv
            if self.decode_mode == "auto":
                self.decode_mode = "runner" if eng.graph_blocker(1) is None else "packed"
            self.metrics.decode_mode = self.decode_mode
            self._refresh_stats(force=True)
        except BaseException:
            eng.close()
            raise

    def _loop(self) -> None:
        while True:
            with self.cv:
                if not self.waiting and not self.running:
                    self._refresh_stats(force=True)       # idle: /metrics shows the work just done
                while not self._stopping and not self.waiting and not self.running:
                    self.cv.wait(STATS_INTERVAL)
                    self._refresh_stats()
                if self._stopping:
                    return
                self._drop_cancelled()
                admitted = self._admit()
            if admitted:
                self._prefill(admitted)
            self._compact()
            if self.running:
                self._decode()
            self._refresh_stats()

    def _drop_cancelled(self) -> None:
        for job in self.slots:
            if job is not None and job.cancelled:
                self._release(job, "cancelled")

    def _admit(self) -> list[Job]:
        """Waiting jobs moved into free slots, up to `prefill_tokens` prompt tokens (at least one job)."""
        free = [s for s, job in enumerate(self.slots) if job is None]
        admitted: list[Job] = []
        budget = self.prefill_tokens
        while free and self.waiting:
            job = self.waiting[0]
            if admitted and len(job.prompt_ids) > budget:
                break
            self.waiting.popleft()
            job.slot = free.pop(0)
            self.slots[job.slot] = job
            budget -= len(job.prompt_ids)
            admitted.append(job)
        self.metrics.queue_depth = len(self.waiting)
        self.metrics.running = self.running
        return admitted

    def _compact(self) -> None:
        """Running requests into the lowest slots: while a slot below the highest running request is free, that
        request moves down into it (its KV rows of positions 0..pos-1 and its recurrent state are copied on the
        compute stream), so a decode step needs only the bucket of the running count."""
        moves = []
        with self.cv:
            while True:
                free = next((s for s, job in enumerate(self.slots) if job is None), None)
                top = max((s for s, job in enumerate(self.slots) if job is not None), default=-1)
                if free is None or top < free:
                    break
                job = self.slots[top]
                self.slots[free], self.slots[top] = job, None
                job.slot = free
                moves.append((top, free, job.pos))
        if moves:
            with self._engine.stream:
                for src, dst, length in moves:
                    self._kv.move(src, dst, length)
            self.metrics.slot_moves(len(moves))

    def _runner_for(self, rows: int):
        """The smallest bucket's runner with at least `rows` rows (made on first use; it captures its graph on its
        first step where the backend can)."""
        bucket = next(b for b in self.buckets if b >= rows)
        runner = self._runners.get(bucket)
        if runner is None:
            runner = self._runners[bucket] = self._engine.decode_runner(bucket, self.max_seq_len, kv=self._kv)
        return runner

    def decode_graphs(self) -> dict[int, str]:
        """Each bucket's graph: "captured", why not (the runner's reason), or "unused" (no step ran it yet)."""
        out = {}
        for b in self.buckets:
            r = self._runners.get(b)
            if r is None or (r.graph is None and not r.eager_steps):
                out[b] = "unused"
            else:
                out[b] = "captured" if r.graph is not None else r.reason or "not captured"
        return out

    def _prefill(self, jobs: list[Job]) -> None:
        eng = self._engine
        t0 = time.perf_counter()
        try:
            for job in jobs:
                p = job.params
                job.sampler = Sampler(p.temperature, p.top_p, p.seed, top_k=p.top_k, min_p=p.min_p,
                                      repetition_penalty=p.repetition_penalty, context=job.prompt_ids)
                if self.tokenizer is not None:
                    job.stream = TextStream(self.tokenizer, job._pieces.append, p.stop)
            logits = eng.prefill_into(self._runners[self.max_batch_size],
                                      [np.asarray(j.prompt_ids, np.int64) for j in jobs],
                                      seqs=[j.slot for j in jobs])
            tokens = self._pick(jobs, logits, range(len(jobs)))
        except ColibriFormatError as exc:             # e.g. an expert failing its checksum: these requests fail
            for job in jobs:
                self._release(job, None)
                self._fail(job, str(exc), 500)
            return
        self.metrics.prefill(sum(len(j.prompt_ids) for j in jobs), len(jobs), time.perf_counter() - t0)
        for job, token in zip(jobs, tokens):
            job.pos = len(job.prompt_ids)
            self._accept(job, token)

    def _decode(self) -> None:
        eng = self._engine
        active = [job for job in self.slots if job is not None]
        t0 = time.perf_counter()
        try:
            if self.decode_mode == "packed":
                logits = eng.prefill_into(self._runners[self.max_batch_size], [np.array([j.out[-1]]) for j in active],
                                          seqs=[j.slot for j in active], starts=[j.pos for j in active])
                rows: Any = range(len(active))
                batch, graph = len(active), False
            else:
                runner = self._runner_for(max(j.slot for j in active) + 1)    # compacted: the running count
                first = active[0]
                fill = [self.slots[s] or first for s in range(runner.batch)]
                eager = runner.eager_steps
                logits = runner.step(np.array([j.out[-1] for j in fill]), np.array([j.pos for j in fill]))
                rows = [j.slot for j in active]
                batch, graph = runner.batch, runner.eager_steps == eager
                if eager == 0 and not graph:            # the bucket's first step: say what its next ones will be
                    log.info("decode bucket of %d rows: %s", batch,
                             "graph captured" if runner.graph is not None else f"eager ({runner.reason})")
            tokens = self._pick(active, logits, rows)
        except ColibriFormatError as exc:
            for job in active:
                self._release(job, None)
                self._fail(job, str(exc), 500)
            return
        self.metrics.decode_step(len(active), time.perf_counter() - t0, batch=batch, graph=graph)
        for job, token in zip(active, tokens):
            job.pos += 1
            self._accept(job, token)

    def _pick(self, jobs: list[Job], logits, rows) -> list[int]:
        """The next token of each job from its logits row: one device argmax when every job is greedy."""
        eng = self._engine
        rows = list(rows)
        if all(j.params.greedy for j in jobs):
            best = eng.argmax(logits)
            return [best[r] for r in rows]
        host = eng.be.to_host(logits)
        return [j.sampler(np.asarray(host[r], np.float32)) if not j.params.greedy else int(np.argmax(host[r]))
                for j, r in zip(jobs, rows)]

    def _accept(self, job: Job, token: int) -> None:
        """Record `token` for `job`: stream its text, and free the slot when a stop or the length is reached."""
        now = time.perf_counter()
        if job.first_token is None:
            job.first_token = now
            self.metrics.first_token(now - job.arrived)
        job.out.append(int(token))
        reason = None
        if token in job.params.stop_ids:
            reason = "stop"
        elif job.stream is not None:
            job.stream(token)
            if job.stream.stopped:
                reason = "stop"
        if reason is None and len(job.out) >= job.params.max_tokens:
            reason = "length"
        text = "".join(job._pieces)
        job._pieces.clear()
        if not job.cancelled:
            self._send(job, Delta(text, [int(token)]))
        if reason is not None:
            self._release(job, reason)

    def _release(self, job: Job, reason: str | None) -> None:
        """Free the job's slot; with a reason, send its Done (a cancelled job's client is gone: nothing sent)."""
        with self.cv:
            if 0 <= job.slot < len(self.slots) and self.slots[job.slot] is job:
                self.slots[job.slot] = None
            self.metrics.running = self.running
            was_finished, job.finished = job.finished, True
        if reason is None or was_finished:
            return
        self.metrics.count("cancelled" if reason == "cancelled" else "finished")
        if reason == "cancelled":
            return
        text = self._final_text(job)
        if job.stream is not None:
            job.stream.finish(text)             # what was held back (a possible stop string's start)
        tail = "".join(job._pieces)
        job._pieces.clear()
        self._send(job, Done(reason, text, tail, len(job.prompt_ids), len(job.out)))

    def _final_text(self, job: Job) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(job.out)
        at = find_stop(text, job.params.stop) if job.params.stop else -1
        return text[:at] if at >= 0 else text

    def _fail(self, job: Job, message: str, status: int) -> None:
        job.finished = True
        self.metrics.count("failed")
        self._send(job, Failed(message, status))

    def _send(self, job: Job, event: Any) -> None:
        try:
            job.sink(event)
        except Exception:            # noqa: BLE001 - a client's sink must never stop the loop
            log.exception("request %d: its event sink failed; the request is cancelled", job.id)
            job.cancelled = True

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._stats_at < STATS_INTERVAL:
            return
        self._stats_at = now
        self.metrics.engine_stats(self._engine.stats(), now)
        self.metrics.decode_graphs = self.decode_graphs()

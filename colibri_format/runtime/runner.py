"""Step runners: a decode step for B sequences over their own KV buffers (or the first B sequences of buffers shared
with other runners), eager once, then (on a backend with graphs, when nothing in the step needs the host) captured
as a CUDA graph and replayed with static buffers; and a fresh prompt's prefill padded to a bucket of rows, captured
the same way on its bucket's second use."""

from __future__ import annotations

from typing import Callable

import numpy as np

from colibri_format.runtime.forward import HostStep, KVBuffers, StepInputs, Workspace, host_step, rope_rows

MIN_CAPACITY = 64     # KV positions of the smallest runner
CHAIN_STEPS = 16      # greedy decode steps the engine queues at once (`DecodeRunner.chain`): the device runs them
                      # back to back; a stop token inside a chain wastes at most CHAIN_STEPS - 1 steps


PREFILL_BUCKET_ROWS = 64       # a graphed prefill's rows: the prompt padded to a multiple of this, so prompts of
                               # nearby lengths replay one graph (at most 63 rows of padding computed)
PREFILL_GRAPH_MAX_ROWS = 2048  # longer prompts run eager passes: the device's work dwarfs the host's there
PREFILL_GRAPHS_KEPT = 4        # prefill runners an engine keeps (each holds a workspace), the least recent dropped


def capacity_for(length: int, max_seq_len: int) -> int:
    """KV capacity: the next power of two (at least MIN_CAPACITY) so that repeated calls reuse one runner."""
    cap = MIN_CAPACITY
    while cap < length:
        cap *= 2
    return min(cap, max_seq_len)


class DecodeRunner:
    """One decode step for `batch` sequences, `capacity` positions each.

    With `kv` (KV buffers, and recurrent state, of S >= batch sequences and `capacity` positions, made by
    `Engine.new_kv`) the runner owns no buffers: row r of its step is sequence r of `kv`, so runners of several batch
    sizes over one set of buffers each step the lowest sequences (colibri serve's batch buckets); sequences >= batch
    are untouched.
    """

    def __init__(self, eng, batch: int, capacity: int, kv: KVBuffers | None = None) -> None:
        a, be = eng.args, eng.be
        self.eng, self.batch, self.capacity = eng, batch, capacity
        if kv is not None and (kv.seqs < batch or kv.capacity != capacity):
            raise ValueError(f"KV buffers of {kv.seqs} sequences x {kv.capacity} positions cannot serve a runner of "
                             f"{batch} x {capacity}")
        self.kv = eng.new_kv(batch, capacity) if kv is None else kv
        self.ws = Workspace(be)
        self.inp = StepInputs(be, batch, eng.half)
        self.graph = None
        self.eager_steps = 0
        self.reason = eng.graph_blocker(batch)

    def step(self, ids: np.ndarray, pos: np.ndarray):
        """Logits [B, V] (a device buffer overwritten by the next step) after one token per sequence."""
        with self.eng.stream:
            self.inp.fill(self._host_step(ids, pos), self.eng.stream)
            return self._pass()

    def chain(self, ids: np.ndarray, pos: np.ndarray, steps: int,
              before_step: Callable[[int], None] | None = None) -> np.ndarray:
        """Greedy tokens [steps, B] (host int32) of `steps` decode steps from tokens `ids` at positions `pos`: each
        step's token (the device's argmax of its logits) is the next step's input without a trip to the host. Every
        step's other inputs are uploaded at once, so the host queues the steps without waiting for one and the
        device runs them back to back; the tokens are read once, at the end. The host copy of the inputs
        (`StepInputs.host_rows`: a wide pass plans its attention tiles from it) follows each step. `before_step(j)`
        runs on the host before step j is queued (the engine's per-pass bookkeeping). The caller keeps
        pos + steps - 1 within the capacity."""
        if steps < 1:
            raise ValueError(f"a chain takes at least one step, not {steps}")
        eng, B = self.eng, self.batch
        pos = np.asarray(pos, np.int32)
        images = np.stack([self.inp.image(self._host_step(ids, pos + j)) for j in range(steps)])
        with eng.stream:
            staged = eng.be.empty(images.shape, np.int32)
            eng.be.set_from_host(staged, images, eng.stream)
            tokens = eng.be.empty((steps, B), np.int32)
            for j in range(steps):
                if before_step is not None:
                    before_step(j)
                self.inp.dev[...] = staged[j]
                self.inp.host[...] = images[j]      # what the device holds (ids aside): the pass's host rows
                if j:
                    self.inp.ids[:B] = tokens[j - 1]
                tokens[j] = eng.be.xp.argmax(self._pass(), axis=1)
            return eng.be.to_host(tokens)

    def _host_step(self, ids: np.ndarray, pos: np.ndarray) -> HostStep:
        cos, sin = rope_rows(self.eng.args, [np.array([p]) for p in pos])
        rows = np.arange(self.batch, dtype=np.int32)
        return HostStep(np.asarray(ids, np.int32), np.asarray(pos, np.int32), rows, cos, sin, rows)

    def _pass(self):
        """The step's pass on the inputs already on the device: the graph when there is one and no route hook
        (routes wanted: the eager pass), else eager (capturing the graph after the first eager step)."""
        eng, B = self.eng, self.batch
        eng.experts.begin_token(B)
        if self.graph is not None and eng.decoder.route_hook is None:
            eng.be.launch(self.graph, eng.stream)
            logits = self.ws.buf("logits", (B, eng.args.vocab_size))
        else:
            logits = self.run_eager()
            self.eager_steps += 1
            if self.reason is None and eng.decoder.route_hook is None:
                self._capture()
        eng.experts.after_pass(B)      # the expert cache's turn, while the GPU runs the step
        return logits

    def run_eager(self):
        """The step's pass without the graph (the inputs of the last `step`). Recurrent states (Gated DeltaNet) trust
        the step's positions as the KV cache does: an idle slot fed another slot's token restarts its state."""
        state = self.kv.state
        if state is None:
            return self.eng.decoder.run(self.inp, self.kv, self.ws, self.batch, None, max_len=self.capacity)
        state.strict = False
        try:
            return self.eng.decoder.run(self.inp, self.kv, self.ws, self.batch, None, max_len=self.capacity)
        finally:
            state.strict = True

    def _capture(self) -> None:
        self.graph, self.reason = capture_pass(self.eng, self.ws, self.run_eager)


def capture_pass(eng, ws: Workspace, fn, memory=None) -> tuple:
    """(graph, None) of fn's launches on the engine's stream, its workspace frozen (a new buffer then is a bug), or
    (None, why) when the capture fails: the runner stays eager. memory: the graph's own pool (`capture`)."""
    ws.frozen = True
    try:
        return eng.be.capture(eng.stream, fn, memory=memory), None
    except Exception as exc:  # noqa: BLE001 -- any capture failure: stay eager, say why
        return None, f"capture failed: {type(exc).__name__}: {exc}"
    finally:
        ws.frozen = False


def prefill_bucket(length: int) -> int:
    """The rows a graphed prefill of `length` prompt tokens runs on."""
    return -(-length // PREFILL_BUCKET_ROWS) * PREFILL_BUCKET_ROWS


class PrefillRunner:
    """A fresh prompt's prefill (one sequence, from position 0) on `rows` rows, into sequence 0 of `kv` (capacity
    >= rows) or into KV buffers of its own: eager on its first use, captured as a CUDA graph on the second and
    replayed after (`reason` says why not, when the capture failed). The prompt is padded with token 0 at the
    positions after it: causal attention keeps the padding out of every prompt row, its keys and values land past
    the prompt (where decode writes before it reads), and only the last prompt row's logits are read. Models with
    recurrent layers are not padded (the padding would run through their state): the engine does not use this runner
    for them. Positions, rope rows and sequence ids are the same on every run: uploaded once, a run uploads its ids."""

    def __init__(self, eng, rows: int, kv: KVBuffers | None) -> None:
        be = eng.be
        if kv is not None and (kv.capacity < rows or kv.state is not None):
            raise ValueError(f"KV buffers of {kv.capacity} positions (recurrent state: {kv.state is not None}) "
                             f"cannot take a padded prefill of {rows} rows")
        self.eng, self.rows, self.reason = eng, rows, None
        self.kv = eng.new_kv(1, rows) if kv is None else kv
        self.inp = StepInputs(be, rows, eng.half)
        self.inp.fill(host_step(eng.args, [np.zeros(rows, np.int32)], [0], [0], False), eng.stream)
        self.ws = Workspace(be)
        self.out_row = be.zeros(1, np.int32)
        self.graph = None
        self.memory = None      # the graph's own pool: the temporaries its kernel wrappers allocate while captured
        self.logits = None
        self.passes = 0

    def run(self, prompt: np.ndarray):
        """Device logits [1, V] of the prompt's last token (a buffer the next run overwrites)."""
        eng, R, T = self.eng, self.rows, len(prompt)
        if not 0 < T <= R:
            raise ValueError(f"a prompt of {T} tokens does not fit a prefill runner of {R} rows")
        ids = np.zeros(R, np.int32)
        ids[:T] = prompt
        with eng.stream:
            eng.be.set_from_host(self.inp.ids, ids, eng.stream)
            eng.be.set_from_host(self.out_row, np.array([T - 1], np.int32), eng.stream)
            if self.graph is None and self.passes and self.reason is None:
                self._capture()
            if self.graph is not None:
                eng.be.launch(self.graph, eng.stream)
            else:
                self.logits = self._pass()
            self.passes += 1
            return self.logits

    def _pass(self):
        return self.eng.decoder.run(self.inp, self.kv, self.ws, self.rows, self.out_row, max_len=self.rows)

    def _capture(self) -> None:
        """The pass as a graph. Unlike a decode step's, a prefill's kernel wrappers make temporaries (the bf16
        halves of the dense products' inputs, the W8A8 rows, ...): they come from a pool of the graph's own."""
        self.memory = self.eng.be.graph_memory()
        self.graph, self.reason = capture_pass(self.eng, self.ws, self._pass, self.memory)
        if self.graph is None:
            self.memory = None

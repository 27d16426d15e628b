"""Step runners: a decode step for B sequences over their own KV buffers (or the first B sequences of buffers shared
with other runners), eager once, then (on a backend with graphs, when nothing in the step needs the host) captured
as a CUDA graph and replayed with static buffers."""

from __future__ import annotations

import numpy as np

from colibri_format.runtime.forward import HostStep, KVBuffers, StepInputs, Workspace, make_kv, rope_rows

MIN_CAPACITY = 64     # KV positions of the smallest runner


def capacity_for(length: int, max_seq_len: int) -> int:
    """KV capacity: the next power of two (at least MIN_CAPACITY) so that repeated calls reuse one runner."""
    cap = MIN_CAPACITY
    while cap < length:
        cap *= 2
    return min(cap, max_seq_len)


class DecodeRunner:
    """One decode step for `batch` sequences, `capacity` positions each.

    With `kv` (KV buffers, and recurrent state, of S >= batch sequences and `capacity` positions, made by `make_kv`)
    the runner owns no buffers: row r of its step is sequence r of `kv`, so runners of several batch sizes over one
    set of buffers each step the lowest sequences (colibri serve's batch buckets); sequences >= batch are untouched.
    """

    def __init__(self, eng, batch: int, capacity: int, kv: KVBuffers | None = None) -> None:
        a, be = eng.args, eng.be
        self.eng, self.batch, self.capacity = eng, batch, capacity
        if kv is not None and (kv.seqs < batch or kv.capacity != capacity):
            raise ValueError(f"KV buffers of {kv.seqs} sequences x {kv.capacity} positions cannot serve a runner of "
                             f"{batch} x {capacity}")
        self.kv = make_kv(be, a, batch, capacity) if kv is None else kv
        self.ws = Workspace(be)
        self.inp = StepInputs(be, batch, eng.half)
        self.graph = None
        self.eager_steps = 0
        self.reason = eng.graph_blocker(batch)

    def step(self, ids: np.ndarray, pos: np.ndarray):
        """Logits [B, V] (a device buffer overwritten by the next step) after one token per sequence."""
        eng, B = self.eng, self.batch
        cos, sin = rope_rows(eng.args, [np.array([p]) for p in pos])
        rows = np.arange(B, dtype=np.int32)
        host = HostStep(np.asarray(ids, np.int32), np.asarray(pos, np.int32), rows, cos, sin, rows)
        with eng.stream:
            self.inp.fill(host, eng.stream)
            eng.experts.begin_token(B)
            if self.graph is not None and eng.decoder.route_hook is None:   # routes wanted: the eager pass
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
        eng = self.eng
        self.ws.frozen = True
        try:
            self.graph = eng.be.capture(eng.stream, self.run_eager)
        except Exception as exc:  # noqa: BLE001 -- any capture failure: stay eager, say why
            self.graph = None
            self.reason = f"capture failed: {type(exc).__name__}: {exc}"
        finally:
            self.ws.frozen = False

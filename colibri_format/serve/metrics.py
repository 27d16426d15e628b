"""What `/metrics` shows, in the Prometheus text format: request outcomes, tokens and tokens/s, queue depth and
running batch size, the rows each decode step ran (its batch bucket) and whether it replayed a CUDA graph, slot
moves, time to first token, and from the engine's `stats()` (a snapshot the scheduler thread takes about once a
second) the expert cache hit rate and the rate experts are paged in (PCIe GB/s on the CUDA engine).

Counters only grow; gauges are the latest value. Everything is updated from the scheduler thread and the event
loop and read from the event loop, under one lock.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OUTCOMES = ("finished", "cancelled", "failed", "rejected_queue_full", "rejected_invalid")
RATE_WINDOW = 10.0            # seconds of generated tokens behind the tokens/s gauge


class Metrics:
    def __init__(self, max_batch_size: int = 0, max_queue: int = 0) -> None:
        self._lock = threading.Lock()
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.queue_depth = 0
        self.running = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefill_passes = 0
        self.prefill_seconds = 0.0
        self.decode_steps = 0
        self.decode_rows = 0
        self.decode_seconds = 0.0
        self.decode_batches: dict[int, int] = {}      # rows a step ran (runner: its bucket) -> steps
        self.decode_graph_steps = 0                   # steps that replayed a captured graph
        self.decode_eager_steps = 0                   # steps run op by op (packed passes, uncaptured buckets)
        self.slot_moves_total = 0
        self.decode_mode = ""                         # the scheduler's: packed | runner
        self.decode_graphs: dict[int, str] = {}       # bucket -> captured | why not | unused (the scheduler's)
        self.ttft_buckets = [0] * len(TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.engine: dict[str, Any] = {}
        self.paging_gb_per_s = 0.0
        self._paged: tuple[float, int] | None = None

    # --- updates ------------------------------------------------------------------------------------------------
    def count(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.outcomes[outcome] += n

    def prefill(self, prompt_tokens: int, first_tokens: int, seconds: float) -> None:
        with self._lock:
            self.prefill_passes += 1
            self.prefill_seconds += seconds
            self.prompt_tokens += prompt_tokens
            self._tokens(first_tokens)

    def decode_step(self, rows: int, seconds: float, *, batch: int | None = None, graph: bool = False) -> None:
        """One decode step of `rows` running requests that ran `batch` rows (default `rows`), by graph replay or
        not."""
        with self._lock:
            self.decode_steps += 1
            self.decode_rows += rows
            self.decode_seconds += seconds
            b = rows if batch is None else batch
            self.decode_batches[b] = self.decode_batches.get(b, 0) + 1
            if graph:
                self.decode_graph_steps += 1
            else:
                self.decode_eager_steps += 1
            self._tokens(rows)

    def slot_moves(self, n: int) -> None:
        with self._lock:
            self.slot_moves_total += n

    def _tokens(self, n: int) -> None:
        now = time.monotonic()
        self.generation_tokens += n
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self.ttft_buckets[i] += 1

    def engine_stats(self, stats: dict[str, Any], now: float) -> None:
        """A new engine.stats() snapshot; the paging rate is taken between this snapshot and the previous one."""
        paged = _pcie_bytes(stats.get("paging", {}))
        with self._lock:
            if self._paged is not None and now > self._paged[0]:
                self.paging_gb_per_s = (paged - self._paged[1]) / (now - self._paged[0]) / 1e9
            self._paged = (now, paged)
            self.engine = stats

    # --- reading ------------------------------------------------------------------------------------------------
    def tokens_per_s(self) -> float:
        with self._lock:
            now = time.monotonic()
            return sum(n for t, n in self._recent if t >= now - RATE_WINDOW) / RATE_WINDOW

    def snapshot(self) -> dict[str, Any]:
        """The figures as one dict (what `render` formats)."""
        rate = self.tokens_per_s()
        with self._lock:
            paging = self.engine.get("paging", {})
            accesses = paging.get("hits", 0) + paging.get("misses", 0)
            resident = bool(self.engine.get("resident", True))
            hit_rate = paging.get("hits", 0) / accesses if accesses else (1.0 if resident else 0.0)
            return {"queue_depth": self.queue_depth, "running": self.running, "max_batch_size": self.max_batch_size,
                    "max_queue": self.max_queue, "outcomes": dict(self.outcomes),
                    "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                    "tokens_per_s": rate, "prefill_passes": self.prefill_passes,
                    "prefill_seconds": self.prefill_seconds, "decode_steps": self.decode_steps,
                    "decode_rows": self.decode_rows, "decode_seconds": self.decode_seconds,
                    "decode_batches": dict(sorted(self.decode_batches.items())),
                    "decode_graph_steps": self.decode_graph_steps, "decode_eager_steps": self.decode_eager_steps,
                    "slot_moves": self.slot_moves_total, "decode_mode": self.decode_mode,
                    "decode_graphs": dict(self.decode_graphs),
                    "ttft_buckets": list(self.ttft_buckets), "ttft_sum": self.ttft_sum, "ttft_count": self.ttft_count,
                    "experts_resident": resident, "expert_hit_rate": hit_rate,
                    "expert_hits": paging.get("hits", 0), "expert_misses": paging.get("misses", 0),
                    "bytes_paged": _pcie_bytes(paging), "paging_gb_per_s": self.paging_gb_per_s}

    def render(self) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        s = self.snapshot()
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP colibri_{name} {help_text}")
            lines.append(f"# TYPE colibri_{name} {kind}")
            lines.extend(f"colibri_{name}{labels} {_number(value)}" for labels, value in samples)

        metric("requests_total", "counter", "Requests by outcome.",
               [(f'{{outcome="{k}"}}', v) for k, v in s["outcomes"].items()])
        metric("queue_depth", "gauge", "Requests waiting for a slot.", [("", s["queue_depth"])])
        metric("queue_limit", "gauge", "Waiting requests beyond which a request is refused (429).",
               [("", s["max_queue"])])
        metric("running_requests", "gauge", "Requests in the running batch.", [("", s["running"])])
        metric("max_batch_size", "gauge", "Slots of the running batch.", [("", s["max_batch_size"])])
        metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", s["prompt_tokens"])])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", s["generation_tokens"])])
        metric("generation_tokens_per_second", "gauge", f"Tokens generated per second over the last "
               f"{RATE_WINDOW:g} s.", [("", s["tokens_per_s"])])
        metric("prefill_passes_total", "counter", "Prefill passes.", [("", s["prefill_passes"])])
        metric("prefill_seconds_total", "counter", "Seconds spent in prefill passes.", [("", s["prefill_seconds"])])
        metric("decode_steps_total", "counter", "Decode steps.", [("", s["decode_steps"])])
        metric("decode_rows_total", "counter", "Running requests summed over decode steps (mean batch size = "
               "rows / steps).", [("", s["decode_rows"])])
        metric("decode_seconds_total", "counter", "Seconds spent in decode steps.", [("", s["decode_seconds"])])
        batches = sorted(set(s["decode_batches"]) | set(s["decode_graphs"]))
        metric("decode_batch_steps_total", "counter", "Decode steps by the rows they ran: the batch bucket (runner "
               "decode), or the running requests (packed decode).",
               [(f'{{batch="{b}"}}', s["decode_batches"].get(b, 0)) for b in batches])
        metric("decode_steps_by_form_total", "counter", "Decode steps that replayed a captured CUDA graph, and steps "
               "run op by op (packed passes, a bucket's first step, buckets that cannot be captured).",
               [('{form="graph"}', s["decode_graph_steps"]), ('{form="eager"}', s["decode_eager_steps"])])
        metric("decode_graph_captured", "gauge", "1 when the bucket's decode step is a captured CUDA graph (0: not "
               "captured, or not used yet; /health says why).",
               [(f'{{batch="{b}"}}', int(v == "captured")) for b, v in s["decode_graphs"].items()])
        metric("decode_mode", "gauge", "The serving loop's decode form (1 for the one in use).",
               [(f'{{mode="{m}"}}', int(m == s["decode_mode"])) for m in ("packed", "runner")])
        metric("slot_moves_total", "counter", "Running requests moved down into a freed slot (their KV rows and "
               "recurrent state copied) so the running batch stays in the lowest slots.", [("", s["slot_moves"])])
        cumulative = [(f'{{le="{b:g}"}}', n) for b, n in zip(TTFT_BUCKETS, s["ttft_buckets"])]
        lines.append("# HELP colibri_time_to_first_token_seconds From arrival to the first generated token.")
        lines.append("# TYPE colibri_time_to_first_token_seconds histogram")
        lines.extend(f"colibri_time_to_first_token_seconds_bucket{labels} {n}" for labels, n in cumulative)
        lines.append(f'colibri_time_to_first_token_seconds_bucket{{le="+Inf"}} {s["ttft_count"]}')
        lines.append(f"colibri_time_to_first_token_seconds_sum {_number(s['ttft_sum'])}")
        lines.append(f"colibri_time_to_first_token_seconds_count {s['ttft_count']}")
        metric("experts_resident", "gauge", "1 when every expert is resident, 0 when experts are paged.",
               [("", int(s["experts_resident"]))])
        metric("expert_cache_hit_rate", "gauge", "Expert cache hits / accesses (1 when every expert is resident).",
               [("", s["expert_hit_rate"])])
        metric("expert_cache_hits_total", "counter", "Expert accesses served from the cache.", [("", s["expert_hits"])])
        metric("expert_cache_misses_total", "counter", "Expert accesses that paged the expert in.",
               [("", s["expert_misses"])])
        metric("expert_bytes_paged_total", "counter", "Bytes of experts brought from host memory (copied into cache "
               "slots, or read in place by the kernels): PCIe traffic on the CUDA engine.", [("", s["bytes_paged"])])
        metric("expert_paging_gb_per_second", "gauge", "Expert bytes brought from host memory per second between "
               "the last two engine snapshots (PCIe GB/s on the CUDA engine).", [("", s["paging_gb_per_s"])])
        return "\n".join(lines) + "\n"


def _pcie_bytes(paging: dict[str, Any]) -> int:
    """Expert bytes brought from host memory: copied into slots, plus read in place where the engine does that."""
    return int(paging.get("bytes_paged", 0)) + int(paging.get("bytes_zero_copy", 0))


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"

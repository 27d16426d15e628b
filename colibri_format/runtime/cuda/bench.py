"""`colibri bench FILE`: the CUDA engine's speed on one file, against the device's measured limits.

`run_bench(...)` (the library function) measures, on the GPU:

* ceilings: a 1 GiB device-to-device copy (bytes read + written per second) and a pinned host-to-device copy;
* prefill: one forward pass over `seq_len` tokens (median of 3), tokens/s;
* decode: `num_iters` steps of `batch_size` sequences after `warmup_iters` (the step is a replayed CUDA graph
  when all experts are resident), tokens/s, wall and host time per step (host: time spent in Python before
  the step's work is queued);
* per kernel: GPU time of every kernel of one eager decode step, bracketed by CUDA events while a spin kernel
  keeps the GPU busy (so the host's launch gaps are not counted), with the bytes each moves (weights for dense
  GEMVs and experts, K/V for attention) and the achieved GB/s;
* roofline: weight bytes touched per step / copy bandwidth -> the decode tokens/s a bandwidth-bound engine
  could reach; share = measured / roofline;
* paging (when experts are paged): hit rate, misses per token, copy GB/s (copy-stream time), stall per token.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import numpy as np

SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""
PROFILED = ("embedding", "rmsnorm", "add_rmsnorm", "add_rmsnorm_route", "qkv_rope_kv", "dense_gemv", "attention",
            "residual_add", "router", "moe_experts", "moe_experts_4bit", "silu_mul",
            "split_bf16", "mla_attention")      # the backend's calls into kernels/ops.py


# --- random experts for kernel benchmarks ------------------------------------------------------------------------
def layout_for(hidden: int, inter: int, group: int = 0):
    """The int8 blob layout of an expert (per-row scales, or groups of `group`)."""
    from colibri_format.spec import ExpertFormat, blob_layout

    return blob_layout(hidden, inter, ExpertFormat.INT8_GROUP if group else ExpertFormat.INT8_ROW, group)


def numpy_experts(blobs: np.ndarray, layout):
    """experts(e) -> (gate_up [2I, H], down [H, I]) float64 of host blobs (uint8 [E * layout.size]): the oracle's
    view of the bytes the kernels read. The callable keeps `blobs` alive."""
    from colibri_format.runtime import numpy_backend

    blobs = np.ascontiguousarray(blobs, np.uint8)

    def experts(e: int):
        return numpy_backend.blob_arrays(blobs.ctypes.data + int(e) * layout.size, layout, np.float64)

    return experts


def device_experts(num_experts: int, hidden: int, inter: int, group: int = 0, seed: int = 0):
    """Random int8 experts generated on the GPU (benchmark-sized shapes); returns (buffer, ExpertTable)."""
    import cupy as cp

    from colibri_format.runtime.cuda.kernels.ops import ExpertTable

    layout = layout_for(hidden, inter, group)
    buf = cp.zeros(num_experts * layout.size, cp.uint8)
    rs = cp.random.RandomState(seed)
    for e in range(num_experts):
        for name in ("gate_up", "down"):
            a = layout.array(name)
            n, off = a.shape[0] * a.shape[1], e * layout.size + a.offset
            buf[off:off + n] = rs.randint(0, 255, n, dtype=cp.int32).astype(cp.uint8)
        for name in ("gate_up_scale", "down_scale"):     # about what a quantizer gives: max|w| / 127
            a = layout.array(name)
            n, off = a.shape[0] * a.shape[1], e * layout.size + a.offset
            vals = (rs.uniform(0.5, 1.5, n) * 3.0 / (127.0 * np.sqrt(layout.hidden_size))).astype(cp.float32)
            buf[off:off + 4 * n] = vals.view(cp.uint8)
    ptrs = cp.asarray(np.array([buf.data.ptr + e * layout.size for e in range(num_experts)], np.uint64))
    return buf, ExpertTable.from_layout(ptrs, layout)


# --- ceilings -----------------------------------------------------------------------------------------------
def copy_ceilings(be, stream, nbytes: int = 1 << 30, reps: int = 5) -> dict:
    xp = be.xp
    with stream:
        src, dst = xp.ones(nbytes, xp.uint8), xp.empty(nbytes, xp.uint8)
        times = []
        for _ in range(reps + 1):
            a = be.timing_event(stream)
            xp.copyto(dst, src)
            times.append(be.elapsed_ms(a, be.timing_event(stream)))
        d2d = 2 * nbytes / (statistics.median(times[1:]) / 1e3) / 1e9
        del src, dst
        host = be.pinned_empty(min(nbytes, 256 << 20))
        host[:] = 1
        dev = xp.empty(host.size, xp.uint8)
        times = []
        for _ in range(reps + 1):
            a = be.timing_event(stream)
            be.copy_htod(be.ptr(dev), int(host.ctypes.data), host.size, stream)
            times.append(be.elapsed_ms(a, be.timing_event(stream)))
        h2d = host.size / (statistics.median(times[1:]) / 1e3) / 1e9
    return {"d2d_copy_gbps": d2d, "h2d_pinned_gbps": h2d}


# --- per-kernel profile -----------------------------------------------------------------------------------------
def _bytes_of(name: str, args: tuple, kw: dict, be) -> Any:
    """Bytes a call must move (weights / KV), or a thunk evaluated after the step (needs device counts)."""
    if name == "dense_gemv":
        return int(args[1].nbytes)
    if name in ("moe_experts", "moe_experts_4bit"):   # each routed expert read once (by whichever kernels run)
        ids, table = args[1], args[3]
        H, I, g = table.hidden_size, table.intermediate_size, table.group_size
        per_expert = table.weight_bytes() if name == "moe_experts_4bit" else \
            3 * H * I + 4 * (2 * I * (H // g if g else 1) + H * (I // g if g else 1))
        if kw.get("extras") is not None:      # gpt-oss: each active expert's f32 gate/up and down bias rows
            per_expert += 4 * (2 * I + H)
        return lambda: _routed_experts(be.to_host(ids), table.num_experts) * per_expert
    if name == "attention":
        kc, q_len = args[1], args[4]
        row = kc.shape[2] * kc.shape[3] * kc.dtype.itemsize * 2
        return lambda: int(be.to_host(q_len).sum()) * row
    return None


def _routed_experts(ids: np.ndarray, num_experts: int) -> int:
    """Distinct experts of ids in [0, num_experts) (what dispatch counts as active; by-pair passes run no dispatch)."""
    return int(np.unique(ids[(ids >= 0) & (ids < num_experts)]).size)


def profile_step(eng, runner) -> dict:
    """GPU time and bytes per kernel kind over one eager decode step (the runner's last inputs)."""
    be, stream = eng.be, eng.stream
    records: list = []

    def record(name, start, end, args, kw):
        if name in PROFILED:
            records.append((name, start, end, _bytes_of(name, args, kw, be)))

    with stream:     # ~0.1 s of spinning first: the host queues the whole step meanwhile
        be.xp.RawKernel(SPIN_SOURCE, "spin")((1,), (1,), (np.int64(200_000_000),))
        with be.profiled(record):
            runner.run_eager()
        be.sync_event(be.record(stream))
    kinds: dict[str, dict] = {}
    for name, a, b, nbytes in records:
        k = kinds.setdefault(name, {"calls": 0, "us": 0.0, "bytes": 0})
        k["calls"] += 1
        k["us"] += 1e3 * be.elapsed_ms(a, b)
        nbytes = nbytes() if callable(nbytes) else nbytes
        k["bytes"] = (k["bytes"] or 0) + (nbytes or 0)
    for k in kinds.values():
        k["gbps"] = k["bytes"] / (k["us"] * 1e-6) / 1e9 if k["bytes"] and k["us"] else None
    return kinds


def timeline_profile(eng, step: Callable[[], None], steps: int = 8) -> dict | None:
    """Every kernel, copy and memset of `steps` calls of `step` (decode steps: graph replays included) as the
    device ran them, read from CUPTI through PyTorch's profiler, so the figures add up to the step: per kind,
    calls and microseconds per step; `busy_us` (union of the intervals), `span_us` (first start to last end,
    per step) and `idle_us` = span - busy (the device waiting between kernels). None without PyTorch."""
    return device_timeline(step, lambda: eng.be.sync_event(eng.be.record(eng.stream)), steps)


def device_timeline(step: Callable[[], None], sync: Callable[[], None], steps: int = 8) -> dict | None:
    """`timeline_profile` of any work: `sync` waits until the device has run what `step` queued (e.g. a stream's
    synchronize). None without PyTorch."""
    try:
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 -- CUPTI, only when asked
    except ImportError:
        return None
    step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    fd, trace = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(trace)
        with open(trace, encoding="utf-8") as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(trace)
    return summarize_timeline(events, steps)


def summarize_timeline(events: list[dict], steps: int) -> dict:
    """Per-kind totals of a Chrome trace's device events (cat kernel / gpu_memcpy / gpu_memset), per step."""
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    kinds: dict[str, dict] = {}
    for e in device:
        name = e["name"] if e["cat"] == "kernel" else e["cat"]
        k = kinds.setdefault(name, {"calls": 0, "us": 0.0})
        k["calls"] += 1
        k["us"] += float(e["dur"])
    for k in kinds.values():
        k["calls"] /= steps
        k["us"] /= steps
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device)
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a >= end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    return {"steps": steps, "kinds": kinds, "kernels_per_step": sum(k["calls"] for k in kinds.values()),
            "busy_us": busy / steps, "span_us": span / steps, "idle_us": (span - busy) / steps}


# --- phases -------------------------------------------------------------------------------------------------------
def prefill_bench(eng, seq_len: int, rng) -> dict:
    """Median time of a `seq_len`-token `infer` (after one warm-up): any backend."""
    prompt = rng.integers(0, eng.vocab_size, seq_len).tolist()
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        eng.infer([prompt])
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[1:])
    return {"tokens": seq_len, "ms": 1e3 * t, "tokens_per_s": seq_len / t}


def decode_bench(eng, batch: int, num_iters: int, warmup: int, rng, context: int = 16,
                 before_step: Callable[[], None] | None = None) -> tuple[dict, Any]:
    """(figures, runner): `num_iters` timed greedy steps of `batch` sequences of `context` prompt tokens (which the
    steps attend to) after `warmup`, a step at a time (the token read by the host each step), with the paging
    counters of the timed steps when experts are paged; then the same steps again (same tokens, positions and KV
    rows) as one chain, tokens fed back on the device (`chained_*`, `chained_paging`; greedy `generate` queues
    `Engine.chain_steps` steps a chain): any backend.
    `before_step` runs before every step (e.g. a replayed trace filling the decoder's forced-route buffers on the
    compute stream)."""
    step = before_step or (lambda: None)
    chunks = [rng.integers(0, eng.vocab_size, context) for _ in range(batch)]
    runner = eng.decode_runner(batch, context + warmup + num_iters + 1)
    tok = eng.argmax(eng.prefill_into(runner, chunks))
    pos = np.full(batch, context)
    for _ in range(warmup):
        step()
        tok = eng.argmax(runner.step(np.array(tok), pos))
        pos = pos + 1
    first = (np.array(tok), pos)
    host = 0.0

    def single_steps() -> None:
        nonlocal tok, pos, host
        for _ in range(num_iters):
            h0 = time.perf_counter()
            step()
            logits = runner.step(np.array(tok), pos)
            host += time.perf_counter() - h0
            tok = eng.argmax(logits)
            pos = pos + 1

    wall, paging = _timed_steps(eng, single_steps, num_iters * batch)
    res = {"batch": batch, "context": context, "steps": num_iters, "tokens_per_s": batch * num_iters / wall,
           "ms_per_step": 1e3 * wall / num_iters, "host_ms_per_step": 1e3 * host / num_iters,
           "graph": "captured" if runner.graph is not None else runner.reason}
    runner.chain(*first, min(2, num_iters))     # compiles what only a chain runs (the device argmax) untimed
    chained, chained_paging = _timed_steps(eng, lambda: runner.chain(*first, num_iters, lambda j: step()),
                                           num_iters * batch)
    res.update(chained_tokens_per_s=batch * num_iters / chained, chained_ms_per_step=1e3 * chained / num_iters)
    if paging is not None:
        res.update(paging=paging, chained_paging=chained_paging)
    return res, runner


def _timed_steps(eng, run: Callable[[], None], tokens: int) -> tuple[float, dict | None]:
    """(wall seconds of run(), the paging counters of its `tokens` tokens when experts are paged)."""
    eng.experts.flush()                # the cache accounts one pass late: settle it outside the timed steps
    c0 = eng.experts.counters.as_dict()
    eng.experts.time_copies = True
    eng.experts.copy_bandwidth()
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    eng.experts.time_copies = False
    copy_s, copies = eng.experts.copy_bandwidth()
    eng.experts.flush()
    if eng.experts.resident:
        return wall, None
    return wall, _paging_delta(c0, eng.experts.counters.as_dict(), tokens, copy_s, copies)


def _paging_delta(c0: dict, c1: dict, tokens: int, copy_s: float, copies: int) -> dict:
    d = {k: c1[k] - c0[k] for k in ("hits", "misses", "loads", "prefetch_loads", "bytes_paged", "bytes_zero_copy",
                                   "stall_seconds", "copy_seconds", "predicted", "predicted_correct",
                                   "actual_next")}
    acc = d["hits"] + d["misses"]
    copy_s = copy_s or d["copy_seconds"]      # no copy-stream timing (NumPy backend): the copies' host time
    return {"hit_rate": d["hits"] / acc if acc else 0.0, "misses_per_token": d["misses"] / tokens,
            "loads_per_token": d["loads"] / tokens, "prefetch_loads": d["prefetch_loads"],
            "prefetch_recall": d["predicted_correct"] / d["actual_next"] if d["actual_next"] else None,
            "prefetch_precision": d["predicted_correct"] / d["predicted"] if d["predicted"] else None,
            "gb_copied": d["bytes_paged"] / 1e9, "gb_zero_copy": d["bytes_zero_copy"] / 1e9,
            "pcie_mb_per_token": (d["bytes_paged"] + d["bytes_zero_copy"]) / tokens / 1e6, "copies": copies,
            "copy_gbps": d["bytes_paged"] / copy_s / 1e9 if copy_s else None,
            "stall_ms_per_token": 1e3 * d["stall_seconds"] / tokens}


def dense_weight_bytes(eng) -> int:
    """Bytes of the dense matrices one decode step reads as stored (all but the embedding, unless tied; gpt-oss's
    per-expert bias matrices are counted with the experts a step reads, `_bytes_of`)."""
    a, w = eng.args, eng.dense
    head = "embed_tokens" if a.tied or not w.has("lm_head") else "lm_head"
    return sum(int(arr.nbytes) for name, arr in w.arrays.items()
               if arr.ndim == 2 and (name != "embed_tokens" or head == "embed_tokens")
               and not name.endswith(("expert_gate_up_bias", "expert_down_bias")))


def _roofline(kernels: dict, ceilings: dict, batch: int, decode_tps: float, dense_bytes: int) -> dict:
    """Weight bytes per step: the dense matrices as stored (whether dense_gemv or cuBLAS reads them) plus the
    distinct experts the step's profile touched."""
    experts = ("moe_experts", "moe_experts_4bit")
    weights = dense_bytes + sum(kernels.get(name, {}).get("bytes", 0) or 0 for name in experts)
    bw = ceilings["d2d_copy_gbps"] * 1e9
    step_s = weights / bw if bw else 0.0
    roof = batch / step_s if step_s else 0.0
    return {"weight_bytes_per_step": weights, "roofline_tokens_per_s": roof,
            "share_of_roofline": decode_tps / roof if roof else None}


def run_bench(path, *, batch_size: int = 1, seq_len: int = 512, num_iters: int = 32, warmup_iters: int = 4,
              context: int = 16,
              max_cached_experts: int | None = None, gpu_memory: int | str | None = None,
              cache_policy: str = "lrfu", cache_scope: str = "global",
              prefetch: bool = False, device_id: int = 0, use_graphs: bool = True, profile: bool = True,
              prefill: bool = True, forced_routes=None, seed: int = 0, engine=None,
              ceiling_bytes: int = 1 << 30, verify: str = "first-use",
              int8_activations: bool = True, kv_cache_dtype: str = "auto") -> dict:
    """Benchmark the CUDA engine on one file; returns a JSON-ready dict (see the module docstring). Decode steps
    follow a prompt of `context` tokens a sequence (attention's work grows with it)."""
    from colibri_format.errors import InvalidInput
    from colibri_format.runtime.engine import Engine, EngineConfig

    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("num_iters", num_iters),
                    ("context", context)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidInput(f"{name} must be a positive integer", field=name, value=v)
    if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
        raise InvalidInput("warmup_iters must be an integer >= 0", field="warmup_iters", value=warmup_iters)
    rng = np.random.default_rng(seed)
    cfg = EngineConfig(device="cuda", device_id=device_id, max_batch_size=max(batch_size, 1),
                       max_seq_len=max(seq_len, context + warmup_iters + num_iters + 1), verify=verify,
                       max_cached_experts=max_cached_experts, gpu_memory=gpu_memory, cache_policy=cache_policy,
                       cache_scope=cache_scope, use_graphs=use_graphs, prefetch=prefetch,
                       int8_activations=int8_activations, kv_cache_dtype=kv_cache_dtype)
    eng = engine or Engine(path, cfg)
    try:
        eng.decoder.forced_routes = forced_routes
        result: dict = {"file": str(path), "config": {"batch_size": batch_size, "seq_len": seq_len, "context": context,
                                                      "num_iters": num_iters, "warmup_iters": warmup_iters,
                                                      "max_cached_experts": max_cached_experts,
                                                      "cache_policy": cache_policy, "cache_scope": cache_scope,
                                                      "prefetch": prefetch,
                                                      "int8_activations": eng.config.int8_activations,
                                                      "kv_cache_dtype": eng.config.kv_cache_dtype}}
        result["ceilings"] = copy_ceilings(eng.be, eng.stream, ceiling_bytes)
        result["engine"] = {k: v for k, v in eng.stats().items() if k not in ("paging", "graphs", "cache")}
        if prefill:
            result["prefill"] = prefill_bench(eng, seq_len, rng)
        decode, runner = decode_bench(eng, batch_size, num_iters, warmup_iters, rng, context=context)
        result["decode"] = decode
        if profile:
            ids, pos = np.zeros(batch_size, np.int64), np.full(batch_size, runner.capacity - 1)
            timeline = timeline_profile(eng, lambda: runner.step(ids, pos))
            if timeline is not None:
                result["timeline"] = timeline
            kernels = profile_step(eng, runner)
            result["kernels"] = kernels
            result["roofline"] = _roofline(kernels, result["ceilings"], batch_size, decode["tokens_per_s"],
                                           dense_weight_bytes(eng))
        return result
    finally:
        if engine is None:
            eng.close()


def render(result: dict) -> str:
    lines = [f"{result['file']}",
             f"copy ceiling {result['ceilings']['d2d_copy_gbps']:.0f} GB/s (device), "
             f"{result['ceilings']['h2d_pinned_gbps']:.1f} GB/s (pinned host->device)"]
    if "prefill" in result:
        p = result["prefill"]
        lines.append(f"prefill {p['tokens']} tokens: {p['ms']:.2f} ms ({p['tokens_per_s']:.0f} tokens/s)")
    d = result["decode"]
    at = f" after {d['context']} tokens" if "context" in d else ""
    lines.append(f"decode batch {d['batch']}{at}: {d['tokens_per_s']:.1f} tokens/s, {d['ms_per_step']:.3f} ms/step, "
                 f"host {d['host_ms_per_step']:.3f} ms/step, graph: {d['graph']}")
    if "chained_tokens_per_s" in d:
        lines.append(f"decode batch {d['batch']}, tokens fed back on the device: {d['chained_tokens_per_s']:.1f} "
                     f"tokens/s, {d['chained_ms_per_step']:.3f} ms/step")
    if "roofline" in result:
        r = result["roofline"]
        share = r["share_of_roofline"]
        lines.append(f"roofline {r['roofline_tokens_per_s']:.1f} tokens/s ({r['weight_bytes_per_step'] / 1e6:.1f} MB "
                     f"weights per step); share {share:.0%}" if share is not None else "roofline: n/a")
    if "paging" in d:
        p = d["paging"]
        lines.append(f"paging: hit rate {p['hit_rate']:.1%}, {p['misses_per_token']:.2f} misses/token, "
                     f"{p['pcie_mb_per_token']:.2f} MB/token over PCIe, copies "
                     f"{'n/a' if p['copy_gbps'] is None else format(p['copy_gbps'], '.1f') + ' GB/s'}, "
                     f"stall {p['stall_ms_per_token']:.3f} ms/token")
    if "timeline" in result:
        t = result["timeline"]
        lines.append(f"device timeline of a decode step (CUPTI): span {t['span_us']:.1f} us = busy {t['busy_us']:.1f} "
                     f"+ idle {t['idle_us']:.1f}; {t['kernels_per_step']:.0f} kernels and copies")
        lines.append(f"{'kernel':<40}{'calls':>7}{'us':>10}{'share':>7}")
        for name, k in sorted(t["kinds"].items(), key=lambda kv: -kv[1]["us"]):
            lines.append(f"{name[:39]:<40}{k['calls']:>7.0f}{k['us']:>10.1f}{k['us'] / t['span_us']:>7.1%}")
    if "kernels" in result:
        lines.append(f"{'kernel':<18}{'calls':>6}{'us':>10}{'GB/s':>9}")
        for name, k in sorted(result["kernels"].items(), key=lambda kv: -kv[1]["us"]):
            gbps = f"{k['gbps']:.0f}" if k["gbps"] else "-"
            lines.append(f"{name:<18}{k['calls']:>6}{k['us']:>10.1f}{gbps:>9}")
    return "\n".join(lines)

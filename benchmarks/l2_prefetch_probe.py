"""Can a batch-1 decode step fetch its next dense weights into L2 while a latency-bound kernel runs? (issue 14; CuPy
and a GPU.)

    PYTHONPATH=. python3 benchmarks/l2_prefetch_probe.py --out OUT_DIR [--layers 48] [--wait-us 10] [--replays 20]

At batch 1 a decode layer spends ~24 µs of Qwen3-30B-A3B's ~65 in kernels that read almost nothing (attention over a
short context, the router, the rope, the combine: docs/benchmarks.md, session 27) while HBM idles, and its dense
GEMVs follow them (the normed q|k|v product reads its 21 MB at 2.3 TB/s of a ~4.1 TB/s copy rate). This probe times a chain of
`--layers` layers, each a stand-in for the latency-bound part (`wait`: 32 blocks spinning `--wait-us` on the clock,
no memory) followed by the engine's own `ops.dense_gemv` on that layer's o_proj-shaped bf16 weights (2048 x 4096,
16.8 MB; every layer its own, so nothing is in L2 from the layer before), captured in one CUDA graph:

- `plain`: wait, then the GEMV;
- `bulk`: a second stream, forked at the layer's start and joined before its GEMV, prefetches the layer's weights
  into L2 with sm_90 bulk prefetches (cp.async.bulk.prefetch.L2, 64 KiB each) while the wait runs;
- `lines`: the same with a prefetch.global.L2::evict_last a 128-byte line;
- `bulk + stream`: as `bulk`, with 38 MB of expert-like weights read between the wait and the GEMV (as Qwen3's
  experts run between the router and the next layer's q|k|v product), by default loads; `bulk + stream evict_first`:
  those reads marked L2::evict_first, so that the prefetched lines may outlive them;
- `gemv only` and `wait only`: the parts alone, for the sums.

Every form's last output is checked against `plain`'s (a prefetch must change no result). Writes
l2_prefetch_probe.json and .md to OUT_DIR. What would be worth wiring into the engine: `bulk` or `lines` under
`plain` by more than a few µs a layer, and `bulk + stream evict_first` under `plain + stream`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

N, K = 2048, 4096                       # Qwen3-30B-A3B's o_proj: [hidden, heads * head_dim]
STREAM_BYTES = 38 << 20                 # about a Qwen3 layer's eight experts (gate_up + down, int8)
BULK_CHUNK = 64 << 10
SOURCE = r"""
extern "C" __global__ void wait_clock(long long cycles, int* sink) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(sink, 1);
}

extern "C" __global__ void prefetch_bulk(const char* p, long long bytes, int chunk) {
    const long long n = bytes / chunk;
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    for (long long i = first; i < n; i += step)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" : : "l"(p + i * chunk), "r"(chunk) : "memory");
}

extern "C" __global__ void prefetch_lines(const char* p, long long bytes) {
    for (long long off = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 128; off < bytes;
         off += (long long)gridDim.x * blockDim.x * 128)
        asm volatile("prefetch.global.L2::evict_last [%0];" : : "l"(p + off));
}

// Reads `words` 16-byte words (a stand-in for the experts' weight reads) and folds them into one word a block.
template <bool EVICT_FIRST>
__device__ void stream_read(const uint4* p, long long words, unsigned int* out) {
    unsigned int acc = 0;
    unsigned long long policy = 0;
    if (EVICT_FIRST) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    for (long long i = first; i < words; i += step) {
        uint4 v;
        if (EVICT_FIRST)
            asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i), "l"(policy));
        else
            v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    atomicXor(out + blockIdx.x, acc);
}
extern "C" __global__ void stream_plain(const uint4* p, long long words, unsigned int* out) {
    stream_read<false>(p, words, out);
}
extern "C" __global__ void stream_evict_first(const uint4* p, long long words, unsigned int* out) {
    stream_read<true>(p, words, out);
}
"""
FORMS = ("plain", "bulk", "lines", "plain + stream", "bulk + stream", "bulk + stream evict_first", "gemv only",
         "wait only")


class Probe:
    def __init__(self, cp, layers: int, wait_us: float) -> None:
        from colibri_format.runtime.cuda.kernels import ops  # noqa: PLC0415

        self.cp, self.ops, self.layers = cp, ops, layers
        module = cp.RawModule(code=SOURCE, options=("-std=c++17",))
        self.fn = {name: module.get_function(name) for name in
                   ("wait_clock", "prefetch_bulk", "prefetch_lines", "stream_plain", "stream_evict_first")}
        props = cp.cuda.runtime.getDeviceProperties(0)
        self.sms = props["multiProcessorCount"]
        self.cycles = int(wait_us * props["clockRate"] * 1e-3)      # clockRate: kHz
        rng = cp.random.default_rng(0)
        self.weights = [self._bf16(rng.standard_normal((N, K), dtype=cp.float32) * 0.02) for _ in range(layers)]
        self.x = rng.standard_normal((1, K), dtype=cp.float32)
        self.y = [cp.empty((1, N), cp.float32) for _ in range(layers)]
        self.experts = cp.zeros(STREAM_BYTES // 16 * 4, cp.uint32)
        self.fold = cp.zeros(4 * self.sms, cp.uint32)
        self.sink = cp.zeros(1, cp.int32)
        self.main = cp.cuda.Stream(non_blocking=True)
        self.side = cp.cuda.Stream(non_blocking=True)

    def _bf16(self, a):
        """float32 -> bf16 bits (round to nearest even), as the engine stores dense weights."""
        u = a.view(self.cp.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(self.cp.uint16)

    def _prefetch(self, kind: str, w) -> None:
        nbytes = np.int64(w.nbytes)
        with self.side:
            if kind == "bulk":
                self.fn["prefetch_bulk"]((self.sms,), (32,), (w, nbytes, np.int32(BULK_CHUNK)))
            else:
                self.fn["prefetch_lines"]((self.sms,), (256,), (w, nbytes))

    def _layer(self, form: str, i: int) -> None:
        cp, w = self.cp, self.weights[i]
        prefetch = "bulk" if form.startswith("bulk") else "lines" if form == "lines" else None
        if prefetch:
            fork = cp.cuda.Event(disable_timing=True)
            fork.record(self.main)
            self.side.wait_event(fork)
            self._prefetch(prefetch, w)
        if form != "gemv only":
            self.fn["wait_clock"]((32,), (128,), (np.int64(self.cycles), self.sink), stream=self.main)
        if "stream" in form:
            name = "stream_evict_first" if form.endswith("evict_first") else "stream_plain"
            self.fn[name]((4 * self.sms,), (256,), (self.experts, np.int64(STREAM_BYTES // 16), self.fold),
                          stream=self.main)
        if prefetch:
            join = cp.cuda.Event(disable_timing=True)
            join.record(self.side)
            self.main.wait_event(join)
        if form != "wait only":
            with self.main:
                self.ops.dense_gemv(self.x, w, out=self.y[i])

    def time(self, form: str, replays: int) -> dict:
        cp = self.cp
        for i in range(self.layers):         # once eagerly: every module loaded before the capture
            self._layer(form, i)
        for y in self.y:
            y.fill(np.nan)
        cp.cuda.Device().synchronize()
        with self.main:
            self.main.begin_capture()
            try:
                for i in range(self.layers):
                    self._layer(form, i)
            finally:
                graph = self.main.end_capture()
        graph.launch(self.main)
        self.main.synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(self.main)
        for _ in range(replays):
            graph.launch(self.main)
        stop.record(self.main)
        stop.synchronize()
        us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / replays / self.layers
        return {"form": form, "us_per_layer": round(us, 2), "last_output": cp.asnumpy(self.y[-1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--wait-us", type=float, default=10.0, help="the latency-bound stand-in's length (µs)")
    ap.add_argument("--replays", type=int, default=20)
    a = ap.parse_args()
    try:
        import cupy as cp  # noqa: PLC0415 -- only this benchmark needs it
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 -- no CuPy, no driver or no GPU: one line, not a traceback
        print(f"l2_prefetch_probe.py needs CuPy and a CUDA GPU ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    probe = Probe(cp, a.layers, a.wait_us)
    rows = [probe.time(form, a.replays) for form in FORMS]
    reference = rows[0]["last_output"]
    for r in rows:
        out = r.pop("last_output")
        r["output"] = "-" if r["form"] == "wait only" else "same" if np.array_equal(out, reference) else "DIFFERS"
    gemv_alone = next(r["us_per_layer"] for r in rows if r["form"] == "gemv only")
    wait_alone = next(r["us_per_layer"] for r in rows if r["form"] == "wait only")
    nbytes = N * K * 2
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "layers": a.layers,
            "wait_us": a.wait_us, "weights_mb_per_layer": nbytes / 1e6, "stream_mb": STREAM_BYTES / 1e6,
            "gemv_alone_gbps": round(nbytes / (gemv_alone * 1e-6) / 1e9, 1)}
    (a.out / "l2_prefetch_probe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"{meta['device']}: {a.layers} layers of a {a.wait_us:g} µs wait and a {nbytes / 1e6:.1f} MB bf16 GEMV "
             f"(alone {gemv_alone:.2f} µs = {meta['gemv_alone_gbps']} GB/s; wait alone {wait_alone:.2f} µs)", "",
             "| form | µs a layer | output |", "|---|---:|---|"]
    lines += [f"| {r['form']} | {r['us_per_layer']:.2f} | {r['output']} |" for r in rows]
    (a.out / "l2_prefetch_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["output"] != "DIFFERS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

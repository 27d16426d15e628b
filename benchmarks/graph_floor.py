"""The floor of a chain of dependent kernels in one CUDA graph on this GPU (issue 14; needs CuPy and a GPU).

    PYTHONPATH=. python3 benchmarks/graph_floor.py --out OUT_DIR [--kernels 480] [--replays 50]

A batch-1 decode step of Qwen3-30B-A3B is ~480 kernels (10 a layer), each waiting for the one before it: whatever
a kernel computes, the step cannot be shorter than the chain's per-kernel floor times its kernel count. This times
that floor: each kernel of the chain reads the hidden-size vector (2048 floats) the kernel before it wrote and writes
its own, as the decode kernels hand on the hidden state, at 1 block, one block per multiprocessor and 4 a
multiprocessor (256 threads each), and the same with a last-block ticket (every block takes an atomic ticket after
a fence and the last one writes: the pattern of the router's, the attention merge's and the split GEMVs' last
blocks). Timed as graph replays between events; also launched from Python without a graph. The chain's result is
checked against NumPy. Writes graph_floor.json and graph_floor.md to OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HIDDEN, THREADS = 2048, 256
SOURCE = r"""
extern "C" __global__ void chain_step(const float* __restrict__ src, float* __restrict__ dst, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        dst[i] = src[i] + 1.0f;
}

// Every block adds its share, then takes a ticket; the last block writes the vector (and resets the counter).
extern "C" __global__ void chain_ticket(const float* __restrict__ src, float* __restrict__ dst,
                                        float* __restrict__ scratch, unsigned int* __restrict__ ticket, int n) {
    __shared__ bool last;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        scratch[i] = src[i];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldcg(scratch + i) + 1.0f;
    if (threadIdx.x == 0) *ticket = 0u;
}
"""


def expected(x0: np.ndarray, kernels: int) -> np.ndarray:
    """Each kernel adds one: a kernel skipped or run twice is off by one."""
    return x0.astype(np.float64) + kernels


def run_chain(cp, fn, args_of, bufs, blocks: int, kernels: int, replays: int, stream) -> dict:
    """µs per kernel of `kernels` chained launches: captured in one graph and replayed, and launched eagerly."""
    def launch_all():
        for k in range(kernels):
            fn((blocks,), (THREADS,), args_of(bufs[k % 2], bufs[(k + 1) % 2]), stream=stream)

    x0 = cp.random.default_rng(0).random(HIDDEN, dtype=cp.float32)
    bufs[0][...] = x0
    with stream:
        stream.begin_capture()
        launch_all()
        graph = stream.end_capture()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    graph.launch(stream)                       # warm-up, then the check of one replay's result
    stream.synchronize()
    got = cp.asnumpy(bufs[kernels % 2])
    want = expected(cp.asnumpy(x0), kernels)
    ok = bool(np.allclose(got, want, rtol=0, atol=0.01))
    start.record(stream)
    for _ in range(replays):
        graph.launch(stream)
    stop.record(stream)
    stop.synchronize()
    graph_us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / replays / kernels
    start.record(stream)
    launch_all()
    stop.record(stream)
    stop.synchronize()
    eager_us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / kernels
    return {"blocks": blocks, "graph_us_per_kernel": round(graph_us, 3), "eager_us_per_kernel": round(eager_us, 3),
            "result_matches": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kernels", type=int, default=480)
    ap.add_argument("--replays", type=int, default=50)
    a = ap.parse_args()
    try:
        import cupy as cp  # noqa: PLC0415 -- only this benchmark needs it
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    except Exception as exc:  # noqa: BLE001 -- no CuPy, no driver or no GPU: one line, not a traceback
        print(f"graph_floor.py needs CuPy and a CUDA GPU ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    module = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    step, ticket_fn = module.get_function("chain_step"), module.get_function("chain_ticket")
    bufs = [cp.zeros(HIDDEN, cp.float32), cp.zeros(HIDDEN, cp.float32)]
    scratch, ticket = cp.zeros(HIDDEN, cp.float32), cp.zeros(1, cp.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for blocks in (1, sms, 4 * sms):
        rows.append({"kernel": "plain", **run_chain(cp, step, lambda s, d: (s, d, np.int32(HIDDEN)), bufs, blocks,
                                                    a.kernels, a.replays, stream)})
        rows.append({"kernel": "last-block ticket",
                     **run_chain(cp, ticket_fn, lambda s, d: (s, d, scratch, ticket, np.int32(HIDDEN)), bufs, blocks,
                                 a.kernels, a.replays, stream)})
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "sms": sms, "kernels": a.kernels,
            "replays": a.replays, "hidden": HIDDEN, "threads": THREADS}
    (a.out / "graph_floor.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"{meta['device']}, {sms} SMs, a chain of {a.kernels} dependent kernels ({HIDDEN} floats handed on)", "",
             "| kernel | blocks | µs a kernel, graph replay | µs a kernel, eager launches | result |",
             "|---|---:|---:|---:|---|"]
    lines += [f"| {r['kernel']} | {r['blocks']} | {r['graph_us_per_kernel']:.2f} | {r['eager_us_per_kernel']:.2f} | "
              f"{'ok' if r['result_matches'] else 'WRONG'} |" for r in rows]
    (a.out / "graph_floor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["result_matches"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where a prefill's wall time goes on the CUDA engine: the host issuing the pass and the device running it, alone
and with the host in the way (issue 15).

    PYTHONPATH=. python benchmarks/prefill_host.py --out OUT_DIR [--shapes qwen3,olmoe,mixtral] [--tokens 512]

Per shape (decode_profile.SHAPES at full depth, real vocabularies): a synthetic file (`write_synthetic(
reuse_expert=True)`, bf16 dense, int8 experts) in --dir, one Engine with EngineConfig's defaults, and per prompt
length, after a warm-up (medians of --repeats):
- wall: `Engine.infer` (host logits, so it includes the sync);
- issue: the host's time to queue the same pass (`Engine._prefill_fresh`, which returns device logits) and the
  wall of that pass once synchronized: issue ~ wall means the host is what the device waits for;
- device: the same pass queued behind a kernel that holds the stream for SPIN_MS, timed with events from the end of
  that kernel to the end of the pass: the device's own time, the host out of the way (valid when the host queued
  the whole pass within SPIN_MS, which is printed: a pass that reads counts on the host, e.g. the cuBLAS W8A8
  expert products, waits for the device and is flagged);
- unless --no-profile, a cProfile of one more `infer` (`prefill_engine.prefill_host_profile`): the functions with
  the most time of their own.
With EngineConfig's defaults a fresh prompt's prefill is replayed as a CUDA graph from its bucket's second use
(`runner.PrefillRunner`): the first two calls (eager, then capture and replay) are reported apart, the medians are
of replays where the pass could be captured (`prefill_graphs` says which).
--fast-gemm names the backend's `fast_expert_gemm` values to time (each switched on the open engine; "defaults":
EngineConfig's), --graphs whether prefill graphs are on, off or both, --router the router's route for long passes
("gemm": cuBLAS from limits.ROUTER_GEMM_MIN_ROWS rows, the default; "fused": the fused kernel at every length) (each
variant's JSON key says; kept graphs follow the switches, `Engine` keys them on `be.kernel_choices()`),
--kv-cache-dtype the KV cache's dtype (auto, bfloat16 or both: an engine each), --dense-gemm the bf16 dense products'
inputs (split or bf16). The file is
deleted after its shape unless --keep (an existing file of that name is then reused: two trees can be timed on one
file, each in its own process). Writes prefill_host.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import SHAPES  # noqa: E402
from prefill_engine import model_of, prefill_host_profile  # noqa: E402
from synthetic_decode import write_timed  # noqa: E402

SPIN_MS = 300        # how long the stream is held while the host queues the pass (longer than any queueing here)
SPIN_SOURCE = r'''
extern "C" __global__ void hold_stream(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { __nanosleep(1000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
'''


def log(msg: str) -> None:
    print(f"[prefill_host {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def issue_and_wall(eng, prompt: list[int], repeats: int) -> tuple[float, float]:
    """Medians (ms) of the host's time to queue one fresh prefill and of that prefill's wall once synchronized."""
    chunks = [np.asarray(prompt, np.int64)]
    issue, wall = [], []
    for _ in range(repeats):
        eng.be.synchronize()
        t0 = time.perf_counter()
        eng._prefill_fresh(chunks)
        t1 = time.perf_counter()
        eng.be.synchronize()
        issue.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(issue), 1e3 * statistics.median(wall)


def device_time(eng, prompt: list[int], repeats: int) -> dict:
    """Medians (ms) of the pass's device time with the host out of the way, and of the host's queueing time then."""
    import cupy

    hold = cupy.RawKernel(SPIN_SOURCE, "hold_stream")
    chunks = [np.asarray(prompt, np.int64)]
    device, queued = [], []
    for _ in range(repeats):
        eng.be.synchronize()
        with eng.stream:
            hold((1,), (1,), (np.uint64(SPIN_MS * 1_000_000),))
            start = eng.be.timing_event(eng.stream)
        t0 = time.perf_counter()
        eng._prefill_fresh(chunks)
        queued.append(time.perf_counter() - t0)
        end = eng.be.timing_event(eng.stream)
        device.append(eng.be.elapsed_ms(start, end))
    q = 1e3 * statistics.median(queued)
    return {"ms": statistics.median(device), "queued_ms": q, "host_waited": q > 0.8 * SPIN_MS}


ROUTER_MIN_ROWS = {"gemm": None, "fused": 1 << 30}     # --router: the backend's router_gemm_min_rows (None: its own)


def measure(path: Path, tokens: list[int], repeats: int, fast_gemms: list[str], profile: bool,
            graphs: list[str], routers: list[str], kv_dtypes: list[str], dense_gemms: list[str]) -> dict:
    import dataclasses

    from colibri_format.runtime import Engine, EngineConfig

    out = {}
    for kv in kv_dtypes:         # an engine each: the KV cache's dtype is chosen when it opens
        with Engine(path, EngineConfig(device="cuda", max_seq_len=max(tokens) + 64, verify="never",
                                       kv_cache_dtype=kv)) as eng:
            default, config, min_rows = eng.be.fast_expert_gemm, eng.config, eng.be.router_gemm_min_rows
            for fast, graph, router, dense in ((f, g, r, d) for f in fast_gemms for g in graphs for r in routers
                                               for d in dense_gemms):
                eng.be.fast_expert_gemm = default if fast == "defaults" else fast
                eng.be.router_gemm_min_rows = ROUTER_MIN_ROWS[router] or min_rows
                eng.be.dense_gemm = dense          # read per call, like the switches above (kernel_choices)
                eng.config = dataclasses.replace(config, use_graphs=graph == "on")   # frozen: swapped whole
                log(f"fast_expert_gemm {eng.be.fast_expert_gemm}, graphs {graph}, router {router}, KV {kv}, "
                    f"dense {dense}")
                key = (fast + ("" if graph == "on" else ", graphs off") + ("" if router == "gemm" else ", fused router")
                       + ("" if kv == "auto" else f", {kv} KV") + ("" if dense == "split" else f", dense {dense}"))
                out[key] = measure_engine(eng, tokens, repeats, profile)
    return out


def measure_engine(eng, tokens: list[int], repeats: int, profile: bool) -> dict:
    out = {}
    for n in tokens:
        prompt = np.random.default_rng(n).integers(0, eng.vocab_size, n).tolist()
        first = []              # the first two calls: a prefill graph's eager pass, then its capture and first replay
        for _ in range(2):
            t0 = time.perf_counter()
            eng.infer([prompt])
            first.append(1e3 * (time.perf_counter() - t0))
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            eng.infer([prompt])
            walls.append(time.perf_counter() - t0)
        issue, wall = issue_and_wall(eng, prompt, repeats)
        r = {"infer_ms": 1e3 * statistics.median(walls), "first_two_ms": first, "issue_ms": issue,
             "pass_wall_ms": wall, "device": device_time(eng, prompt, repeats),
             "prefill_graphs": eng.stats()["prefill_graphs"]}
        d = r["device"]
        log(f"{eng.be.fast_expert_gemm} {n} tokens: first two {first[0]:.1f}, {first[1]:.1f} ms, then infer "
            f"{r['infer_ms']:.1f} ms; pass issued in {issue:.1f} ms, "
            f"done in {wall:.1f}; device alone {d['ms']:.1f} ms (queued in {d['queued_ms']:.1f}"
            f"{', the host waited on the device' if d['host_waited'] else ''})")
        log(f"prefill graphs: {r['prefill_graphs']}")
        r["profile"] = prefill_host_profile(eng, n) if profile else []
        out[str(n)] = r
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3,olmoe,mixtral", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm", help="where the files are written (and deleted)")
    ap.add_argument("--fast-gemm", default="defaults", help="comma list of fast_expert_gemm values, or 'defaults'")
    ap.add_argument("--graphs", default="on", help="comma list of on / off: prefill graphs (EngineConfig.use_graphs)")
    ap.add_argument("--router", default="gemm", help="comma list of gemm / fused: the long passes' router route")
    ap.add_argument("--kv-cache-dtype", default="auto", help="comma list of auto / bfloat16: the KV cache's dtype "
                    "(EngineConfig.kv_cache_dtype; an engine each)")
    ap.add_argument("--dense-gemm", default="split", help="comma list of split / bf16: the prefill's bf16 dense "
                    "products (the backend's dense_gemm, switched on the open engine)")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile")
    ap.add_argument("--keep", action="store_true", help="keep the files (and reuse one already there)")
    a = ap.parse_args()
    if not set(a.graphs.split(",")) <= {"on", "off"}:
        ap.error(f"--graphs takes on, off or both (comma list), not {a.graphs!r}")
    if not set(a.router.split(",")) <= set(ROUTER_MIN_ROWS):
        ap.error(f"--router takes gemm, fused or both (comma list), not {a.router!r}")
    if not set(a.kv_cache_dtype.split(",")) <= {"auto", "bfloat16"}:
        ap.error(f"--kv-cache-dtype takes auto, bfloat16 or both (comma list), not {a.kv_cache_dtype!r}")
    if not set(a.dense_gemm.split(",")) <= {"split", "bf16"}:
        ap.error(f"--dense-gemm takes split, bf16 or both (comma list), not {a.dense_gemm!r}")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in a.tokens.split(",")]
    results = {}
    for name in a.shapes.split(","):
        path = Path(a.dir) / f"prefill_host_{name}.colibri"
        try:
            if not (a.keep and path.exists()):
                write_timed(path, model_of(SHAPES[name]), log)
            results[name] = measure(path, tokens, a.repeats, a.fast_gemm.split(","), not a.no_profile,
                                    a.graphs.split(","), a.router.split(","), a.kv_cache_dtype.split(","),
                                    a.dense_gemm.split(","))
        finally:
            if not a.keep:
                path.unlink(missing_ok=True)
        (out_dir / "prefill_host.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

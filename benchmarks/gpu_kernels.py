"""Check and time the colibri-format CUDA kernels at real MoE shapes on one GPU.

    PYTHONPATH=. python3 benchmarks/gpu_kernels.py --out OUT_DIR [--quick]

(a) correctness: the whole routed-expert block (GEMV and grouped-GEMM paths) at each shape against the NumPy
    backend's `moe` in float64 on the host, reading the same int8 blobs (copied back) with its blob reader;
    (b) timing: each kernel captured in a CUDA graph of many launches (inputs rotated over several expert sets and
    routings so the weights do not sit in L2), median over replays, reported in µs and in GB/s of weight bytes,
    beside a device-to-device copy measured in the same run as the bandwidth ceiling; (c) writes gpu_kernels.json
    and gpu_kernels.md to OUT_DIR.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np


from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda.bench import device_experts, layout_for, numpy_experts
from colibri_format.runtime.cuda.kernels import ops

SHAPES = {  # name: (H, I, E, k, heads, kv_heads, head_dim)
    "Mixtral-8x7B": (4096, 14336, 8, 2, 32, 8, 128),
    "Qwen3-30B-A3B": (2048, 768, 128, 8, 32, 4, 128),
    "OLMoE-1B-7B": (2048, 1024, 64, 8, 16, 16, 128),
}
BATCHES = (1, 32)
CONTEXT = 1024          # KV length for the attention timing
ROTATE_BYTES = 1.5e9    # expert bytes allocated per shape, over which launches rotate


def log(*a):
    print(*a, flush=True)


# ---- timing -------------------------------------------------------------------------------------------------------
def rebuild_module(name: str, **defines: int) -> None:
    """Kernel module `name` compiled anew at its next use with these -D constants changed (this process only)."""
    from colibri_format.runtime.cuda import limits  # noqa: PLC0415

    limits.KERNEL_DEFINES[name].update(defines)
    ops.forget_module(name)


def override_defines(name: str, pairs: list[str], option: str = "--define") -> dict[str, int]:
    """NAME=VALUE pairs (a script's repeatable option) applied to kernel module `name`'s compile-time constants
    (`rebuild_module`), and to limits' and ops.py's copies of a name where they have one (the launch plans read
    ATT_DECODE_MIN_KEYS from ops, the split cap ATT_MAX_SPLITS from limits); a wrong pair stops the script."""
    from colibri_format.runtime.cuda import limits  # noqa: PLC0415

    overrides = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in limits.KERNEL_DEFINES[name]:
            raise SystemExit(f"{option} {pair}: {key} is not one of {sorted(limits.KERNEL_DEFINES[name])}")
        if not value.isdigit() or int(value) < 1:
            raise SystemExit(f"{option} {pair}: the value must be a whole number of at least 1")
        overrides[key] = int(value)
        for module in (ops, limits):
            if hasattr(module, key):
                setattr(module, key, int(value))
    rebuild_module(name, **overrides)
    return overrides


def time_graph(cp, fn_list, reps: int = 25, per_graph: int | None = None) -> float:
    """Median µs per call of fn_list[i] (called round-robin), from CUDA-graph replays of many calls."""
    cp.cuda.Device().synchronize()  # inputs were made on the legacy stream, which a non-blocking one ignores
    stream = cp.cuda.Stream(non_blocking=True)
    n = per_graph or max(len(fn_list), 20)
    with stream:
        for f in fn_list:  # warm-up outside the capture (module load, allocations)
            f()
        stream.synchronize()
        graph = None
        try:
            stream.begin_capture()
            for i in range(n):
                fn_list[i % len(fn_list)]()
            graph = stream.end_capture()
        except Exception as exc:  # noqa: BLE001 -- fall back to plain launches
            log(f"  graph capture failed ({exc!r}); timing plain launches")
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001
                pass
        times = []
        start, end = cp.cuda.Event(), cp.cuda.Event()
        for r in range(reps + 3):
            start.record(stream)
            if graph is not None:
                graph.launch(stream)
            else:
                for i in range(n):
                    fn_list[i % len(fn_list)]()
            end.record(stream)
            end.synchronize()
            if r >= 3:
                times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / n)
    return statistics.median(times)


def copy_bandwidth(cp) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), 2 GiB buffers."""
    n = 1 << 31
    a = cp.ones(n // 4, cp.float32)
    b = cp.empty_like(a)
    for _ in range(3):
        b[...] = a
    cp.cuda.Device().synchronize()
    times = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(10):
        start.record()
        cp.copyto(b, a)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    del a, b
    return 2 * n / statistics.median(times) / 1e9


# ---- the NumPy oracle --------------------------------------------------------------------------------------------
def moe_oracle(experts, x, ids, w) -> np.ndarray:
    """numpy_backend.moe in float64 (no residual) for device x, ids, w; experts from `numpy_experts`."""
    x64 = nb.widen(x.get(), np.float64)
    return nb.moe(x64, ids.get(), nb.widen(w.get(), np.float64), experts, residual=np.zeros(x64.shape))


def rel(a, b) -> float:
    return float(np.linalg.norm(nb.widen(a, np.float64) - b) / np.linalg.norm(b))


# ---- one shape ----------------------------------------------------------------------------------------------------
def routings(rng, T, E, k, n):
    return [np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32) for _ in range(n)]


def bench_shape(cp, name, shape, quick, rows, checks):
    H, I, E, k, nh, nkv, hd = shape
    rng = np.random.default_rng(1)
    layout_bytes = None
    tables = []
    n_layers = 1
    buf0, t0 = device_experts(E, H, I, seed=0)
    layout_bytes = int(buf0.size) // E
    n_layers = max(1, min(4, math.ceil(ROTATE_BYTES / (layout_bytes * E))))
    tables.append((buf0, t0))
    for s in range(1, n_layers):
        tables.append(device_experts(E, H, I, seed=s))
    gu_bytes = 2 * I * H + 2 * I * 4
    dn_bytes = H * I + H * 4
    router_w = cp.asarray((rng.standard_normal((E, H)) / math.sqrt(H)).astype(np.float32)).astype(cp.float16)
    experts0 = numpy_experts(buf0.get(), layout_for(H, I))   # the first table's blobs, for the NumPy oracle

    for T in BATCHES:
        n_rot = 8
        ids_sets = routings(rng, T, E, k, n_rot)
        x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
        wts = cp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
        ids_dev = [cp.asarray(i) for i in ids_sets]
        # (a) correctness of the whole block, both paths, first table and routing
        table = tables[0][1]
        ref = moe_oracle(experts0, x, ids_dev[0], wts)
        for path, gemm, tc in (("gemv", False, None), ("gemm TC", True, True), ("gemm SIMT", True, False)):
            y = ops.moe_experts(x, ids_dev[0], wts, table, gemm=gemm, tensor_cores=tc)
            err = rel(y.get(), ref)
            checks.append({"shape": name, "batch": T, "path": path, "rel_err": err, "ok": err < 1e-4})
            log(f"  check {name} T={T} {path}: rel err {err:.2e}")
        del ref

        # preallocated state per rotation (graph capture must not allocate)
        disps = [ops.dispatch(i, E) for i in ids_dev]
        tokc = ops.tokens_per_pass(T, k, E)
        act = cp.empty((T * k, I), cp.float32)
        ypair = cp.empty((T * k, H), cp.float32)
        y = cp.empty((T, H), cp.float32)
        ws = ops.RouterWorkspace(T, E)
        ids_out = cp.empty((T, k), cp.int32)
        w_out = cp.empty((T, k), cp.float32)
        distinct = [len(np.unique(i)) for i in ids_sets]
        mean_active = float(np.mean(distinct))

        def pick(j):
            return tables[j % n_layers][1], disps[j % n_rot]

        def add(kernel, us, weight_bytes=None, extra=""):
            gbps = weight_bytes / us / 1e3 if weight_bytes else None
            rows.append({"shape": name, "batch": T, "kernel": kernel, "us": us, "weight_bytes": weight_bytes,
                         "GBps": gbps, "note": extra})
            log(f"  {name:14s} T={T:3d} {kernel:22s} {us:9.2f} us" + (f"  {gbps:8.1f} GB/s" if gbps else "")
                + (f"  {extra}" if extra else ""))

        nf = n_rot * n_layers
        us = time_graph(cp, [lambda j=j: ops.router(x, router_w, k, normalize=True, workspace=ws, out_ids=ids_out,
                                                     out_weights=w_out) for j in range(1)])
        add("router (f16 W)", us, E * H * 2, f"E={E} k={k}")
        us = time_graph(cp, [lambda j=j: ops.dispatch(ids_dev[j], E, out=disps[j]) for j in range(n_rot)])
        add("dispatch", us)
        fns = [lambda j=j: ops.moe_gate_up(x, pick(j)[0], pick(j)[1], k, out=act) for j in range(nf)]
        us = time_graph(cp, fns)
        dv = (ops.wide_variant(H) or "t1") if tokc == 1 else f"t{tokc}"
        add(f"gate_up GEMV default", us, mean_active * gu_bytes, f"{dv}; {mean_active:.1f} experts")
        fns = [lambda j=j: ops.moe_down(act, pick(j)[0], pick(j)[1], wts, out=ypair) for j in range(nf)]
        us = time_graph(cp, fns)
        dv = (ops.wide_variant(I) or "t1") if tokc == 1 else f"t{tokc}"
        add("down GEMV default", us, mean_active * dn_bytes, dv)
        if tokc == 1:  # every one-token-per-pass variant (the rows above used the default)
            for v in ("t1",) + ops.GEMV_WIDE:
                fns = [lambda j=j: ops.moe_gate_up(x, pick(j)[0], pick(j)[1], k, variant=v, out=act)
                       for j in range(nf)]
                add(f"gate_up GEMV {v}", time_graph(cp, fns), mean_active * gu_bytes)
                fns = [lambda j=j: ops.moe_down(act, pick(j)[0], pick(j)[1], wts, variant=v, out=ypair)
                       for j in range(nf)]
                add(f"down GEMV {v}", time_graph(cp, fns), mean_active * dn_bytes)
        us = time_graph(cp, [lambda: ops.moe_combine(ypair, k, residual=x, out=y)])
        add("combine (+residual)", us)

        def block(j):
            tb, d = pick(j)
            ops.dispatch(ids_dev[j % n_rot], E, out=d)
            ops.moe_gate_up(x, tb, d, k, out=act)
            ops.moe_down(act, tb, d, wts, out=ypair)
            ops.moe_combine(ypair, k, residual=x, out=y)

        us = time_graph(cp, [lambda j=j: block(j) for j in range(nf)])
        add("MoE block (4 kernels)", us, mean_active * (gu_bytes + dn_bytes), "dispatch+gate_up+down+combine")
        if T > 1 and not quick:
            for tc, label in ((True, "TC"), (False, "SIMT")):
                fns = [lambda j=j: ops.moe_gemm_gate_up(x, pick(j)[0], pick(j)[1], k, tensor_cores=tc, out=act)
                       for j in range(nf)]
                add(f"gate_up GEMM {label}", time_graph(cp, fns), mean_active * gu_bytes)
                fns = [lambda j=j: ops.moe_gemm_down(act, pick(j)[0], pick(j)[1], wts, tensor_cores=tc, out=ypair)
                       for j in range(nf)]
                add(f"down GEMM {label}", time_graph(cp, fns), mean_active * dn_bytes)

            def block_tc(j):
                tb, d = pick(j)
                ops.dispatch(ids_dev[j % n_rot], E, out=d)
                ops.moe_gemm_gate_up(x, tb, d, k, tensor_cores=True, out=act)
                ops.moe_gemm_down(act, tb, d, wts, tensor_cores=True, out=ypair)
                ops.moe_combine(ypair, k, residual=x, out=y)

            us = time_graph(cp, [lambda j=j: block_tc(j) for j in range(nf)])
            add("MoE block (TC GEMM)", us, mean_active * (gu_bytes + dn_bytes), "dispatch+gate_up+down+combine")

        # dense-layer kernels at this batch
        nw = cp.asarray(rng.uniform(0.5, 1.5, H).astype(np.float32))
        hn = cp.empty((T, H), cp.float32)
        add("rmsnorm", time_graph(cp, [lambda: ops.rmsnorm(x, nw, 1e-5, out=hn)]))
        q = cp.asarray(rng.standard_normal((T, nh, hd)).astype(np.float32))
        kc = cp.asarray(rng.standard_normal((T, CONTEXT, nkv, hd)).astype(np.float32)).astype(cp.float16)
        vc = kc.copy()
        q_seq = cp.arange(T, dtype=cp.int32)
        q_len = cp.full(T, CONTEXT, cp.int32)
        ao = cp.empty_like(q)
        ns = ops.attention_splits(T, nkv, nh // nkv, CONTEXT)
        aws = ops.AttentionWorkspace(T, nh, hd, ns)
        us = time_graph(cp, [lambda: ops.attention(q, kc, vc, q_seq, q_len, 1 / math.sqrt(hd), out=ao, nsplit=ns,
                                                   workspace=aws)])
        add(f"attention f16 KV ctx{CONTEXT}", us, 2 * T * CONTEXT * nkv * hd * 2, f"bytes = KV read; {ns} splits")
        wo = cp.asarray(rng.standard_normal((H, nh * hd)).astype(np.float32)).astype(cp.float16)
        xo = cp.asarray(rng.standard_normal((T, nh * hd)).astype(np.float32))
        yo = cp.empty((T, H), cp.float32)
        add("dense GEMV o_proj f16", time_graph(cp, [lambda: ops.dense_gemv(xo, wo, out=yo)]), H * nh * hd * 2)
        del kc, vc

    # prefill: grouped GEMM at 512 tokens
    if not quick:
        T = 512
        ids = cp.asarray(routings(rng, T, E, k, 1)[0])
        x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
        wts = cp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
        buf, table = tables[0]
        d = ops.dispatch(ids, E)
        act = cp.empty((T * k, I), cp.float32)
        ypair = cp.empty((T * k, H), cp.float32)
        flops1, flops2 = 2 * T * k * 2 * I * H, 2 * T * k * H * I
        for tc, label in ((True, "TC"), (False, "SIMT")):
            us1 = time_graph(cp, [lambda: ops.moe_gemm_gate_up(x, table, d, k, tensor_cores=tc, out=act)], reps=5,
                             per_graph=3)
            us2 = time_graph(cp, [lambda: ops.moe_gemm_down(act, table, d, wts, tensor_cores=tc, out=ypair)], reps=5,
                             per_graph=3)
            for kern, us, fl in ((f"gate_up GEMM {label}", us1, flops1), (f"down GEMM {label}", us2, flops2)):
                rows.append({"shape": name, "batch": T, "kernel": kern, "us": us, "weight_bytes": None, "GBps": None,
                             "note": f"prefill {fl / us / 1e6:.1f} TFLOP/s"})
                log(f"  {name:14s} T={T} {kern:22s} {us:9.2f} us  {fl / us / 1e6:.1f} TFLOP/s")
    del tables, experts0


def markdown(meta, rows, checks) -> str:
    bw = meta["copy_GBps"]
    out = [f"Date: {meta['date']} · device: {meta['device']} · CuPy {meta['cupy']} · command: `{meta['command']}`",
           f"Measured device-to-device copy (read + write): **{bw:.0f} GB/s** (ceiling for the % column).", "",
           "| shape | batch | kernel | µs | GB/s (weights) | % of copy BW | note |",
           "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        gb = f"{r['GBps']:.0f}" if r["GBps"] else ""
        pct = f"{100 * r['GBps'] / bw:.0f}%" if r["GBps"] else ""
        out.append(f"| {r['shape']} | {r['batch']} | {r['kernel']} | {r['us']:.2f} | {gb} | {pct} | {r['note']} |")
    out += ["", "| shape | batch | path | rel. error vs float64 | ok |", "| --- | ---: | --- | ---: | --- |"]
    for c in checks:
        out.append(f"| {c['shape']} | {c['batch']} | {c['path']} | {c['rel_err']:.2e} | {c['ok']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="skip the grouped-GEMM timings")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = ap.parse_args(argv)
    import cupy as cp

    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    ops.warm_up()
    log(f"modules compiled in {time.time() - t_start:.1f} s")
    bw = copy_bandwidth(cp)
    log(f"device-to-device copy: {bw:.0f} GB/s")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
            "sm_count": ops._sm_count(), "cupy": cp.__version__, "python": platform.python_version(),
            "command": "PYTHONPATH=. python3 benchmarks/gpu_kernels.py --out $OUT" + (" --quick" if args.quick else ""),
            "copy_GBps": bw}
    rows, checks = [], []
    for name in args.shapes:
        log(f"== {name}")
        bench_shape(cp, name, SHAPES[name], args.quick, rows, checks)
        cp.get_default_memory_pool().free_all_blocks()
    meta["seconds"] = time.time() - t_start
    (args.out / "gpu_kernels.json").write_text(json.dumps({"meta": meta, "rows": rows, "checks": checks}, indent=1))
    md = markdown(meta, rows, checks)
    (args.out / "gpu_kernels.md").write_text(md)
    print(md)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())

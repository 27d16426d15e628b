"""The router of a prefill pass, both routes of `ops.router` side by side (issue 15): the fused kernel (router.cu's
moe_router: logits, softmax and top-k in one launch) against the GEMM route (the weight widened to fp32, cuBLAS's fp32
product, then the selection launch), at several row counts, to place limits.ROUTER_GEMM_MIN_ROWS.

    PYTHONPATH=. python3 benchmarks/router_prefill.py --out OUT_DIR [--rows 16,32,64,128,256,512,2048,4096]

Per router shape (SHAPES: the real models' expert counts, widths, top-k and scoring; weights in bf16 as the files
hold them, x ~ N(0, 1)): µs a call, the median of 25 replays of a CUDA graph of 20 calls (benchmarks/gpu_kernels.
time_graph: the device's time, as a prefill graph replays it). Agreement: the share of tokens whose selected experts
differ between the routes (fp32 sums in another order: near-ties may flip) and the logits' largest relative
difference. Writes router_prefill.json and router_prefill.md to OUT_DIR.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import numpy as np

from benchmarks.gpu_kernels import time_graph
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops

SHAPES = {  # name: (E, H, k, router options)
    "qwen3-30b-a3b": (128, 2048, 8, dict(normalize=True)),
    "olmoe-1b-7b": (64, 2048, 8, dict()),
    "mixtral-8x7b": (8, 4096, 2, dict(normalize=True)),
    "gpt-oss-120b": (128, 2880, 4, dict(order="topk_softmax", bias=True)),
    "deepseek-v3": (256, 7168, 8, dict(scoring="sigmoid", normalize=True, scale=2.5, bias=True, groups=(8, 4))),
}


def log(*a) -> None:
    print(*a, flush=True)


def case(cp, name: str, T: int) -> dict:
    E, H, k, opts = SHAPES[name]
    rs = cp.random.RandomState(T + E)
    x = rs.standard_normal((T, H), dtype=cp.float32)
    w32 = rs.standard_normal((E, H), dtype=cp.float32) / float(np.sqrt(H))   # a float32 array (NEP 50)
    w = (w32.view(cp.uint32) >> 16).astype(cp.uint16)             # bf16 bits (truncated: any bf16 values do)
    how = dict(opts)
    if how.pop("bias", False):
        how["bias"] = rs.standard_normal(E, dtype=cp.float32) * 0.1
    out = {}
    for route, by_gemm in (("fused", False), ("gemm", True)):
        ws = ops.RouterWorkspace(T, E)
        ids, weights = cp.empty((T, k), cp.int32), cp.empty((T, k), cp.float32)

        def call(ws=ws, ids=ids, weights=weights, by_gemm=by_gemm):
            ops.router(x, w, k, workspace=ws, out_ids=ids, out_weights=weights, by_gemm=by_gemm, **how)

        us = time_graph(cp, [call])
        call()
        out[route] = dict(us=us, ids=np.sort(ids.get(), axis=1), logits=ws.logits[:T].get().astype(np.float64))
    fused, gemm = out["fused"], out["gemm"]
    differ = float(np.mean(np.any(fused["ids"] != gemm["ids"], axis=1)))
    logit_rel = float(np.abs(fused["logits"] - gemm["logits"]).max() / np.abs(fused["logits"]).max())
    return dict(shape=name, rows=T, fused_us=fused["us"], gemm_us=gemm["us"], tokens_differ=differ,
                logits_rel=logit_rel)


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"router_prefill.py, {meta['date']}, {meta['device']}; ROUTER_GEMM_MIN_ROWS = {meta['min_rows']}", "",
             "| shape | rows | fused µs | GEMM route µs | fused / GEMM | tokens whose experts differ | logits rel |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['rows']} | {r['fused_us']:.1f} | {r['gemm_us']:.1f} | "
              f"{r['fused_us'] / r['gemm_us']:.2f} | {r['tokens_differ']:.4f} | {r['logits_rel']:.1e} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="16,32,64,128,256,512,2048,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        ap.error(f"--shapes: unknown {sorted(unknown)}; known: {', '.join(SHAPES)}")
    import cupy as cp  # noqa: PLC0415 -- GPU machines only

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), min_rows=limits.ROUTER_GEMM_MIN_ROWS)
    rows = []
    for name in args.shapes.split(","):
        for T in (int(t) for t in args.rows.split(",")):
            rows.append(case(cp, name, T))
            r = rows[-1]
            log(f"{name} T={T}: fused {r['fused_us']:.1f} us, gemm {r['gemm_us']:.1f} us, "
                f"differ {r['tokens_differ']:.4f}, logits rel {r['logits_rel']:.1e}")
    (out / "router_prefill.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / "router_prefill.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

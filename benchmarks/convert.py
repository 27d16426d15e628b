"""Benchmark the converter on a synthetic multi-GB bf16 Mixtral-layout checkpoint, beside gguf-py's Q8_0.

Run from the repository root (the benchmark imports the library, nothing else):

    PYTHONPATH=. .venv/bin/python benchmarks/convert.py --dir /tmp/colibri-bench --gb 8 --workers 2 --doc
    PYTHONPATH=. .venv/bin/python benchmarks/convert.py --dry-run     # tiny dimensions, a few seconds

1. Writes the checkpoint once into --dir (`colibri_format.synthetic.write_mixtral_checkpoint`; reused by later
   runs; --clean deletes it at the end).
2. Reads every shard once (warm page cache), then converts in a child process (the library call
   `colibri_format.convert.pipeline.convert(ckpt, out, workers=N, resume=False)`, which is what
   `colibri convert --workers N --restart` runs) and takes wall time, GB/s of source bytes and the child's peak
   RSS (`getrusage(RUSAGE_CHILDREN).ru_maxrss`).
3. Quantizes the same expert tensors with gguf-py (`gguf.quants.quantize(x, Q8_0)`, one thread, on float32
   as the llama.cpp converter hands it) and with colibri's per-row int8 (`quantize_int8`, one thread, same
   float32), within a value and time budget, and reports values/s, GB/s of bf16 source and the ratios.
4. Per-stage single-thread costs of colibri's streaming path (bf16 upcast, quantize, write+hash), which
   explain the end-to-end figure.
With --doc it appends (or replaces) the `## colibri convert` section of docs/benchmarks.md.
--dry-run checks the script: tiny dimensions (hidden 256, expert intermediate 512, vocab 1,000), a few MB, a
temporary --dir, short quantizer budgets; it never writes the docs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_format.convert.quantize import quantize_int8
from colibri_format.convert.source import open_checkpoint
from colibri_format.dtypes import to_float32
from colibri_format.synthetic import mixtral_checkpoint_config, write_mixtral_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## colibri convert"
FULL = dict(hidden=4096, inter=14336, experts=8, vocab=32000, heads=32, kv_heads=8)   # Mixtral-8x7B's layer
TINY = dict(hidden=256, inter=512, experts=8, vocab=1000, heads=4, kv_heads=2)        # --dry-run


def bench_config(gb: float, dims: dict) -> dict:
    expert_bytes = 3 * dims["hidden"] * dims["inter"] * 2
    layers = max(1, round(gb * 1e9 / (dims["experts"] * expert_bytes)))
    return mixtral_checkpoint_config(vocab=dims["vocab"], hidden=dims["hidden"], layers=layers,
                                     experts=dims["experts"], inter=dims["inter"], heads=dims["heads"],
                                     kv_heads=dims["kv_heads"])


def ensure_checkpoint(path: Path, cfg: dict, shard_bytes: int = 3 << 30, log=None) -> int:
    """A bf16 safetensors checkpoint of `cfg` at `path`, written unless the one there has the same config (kept
    between runs); its source bytes. The line saying it was written goes to `log` (default: standard output)."""
    stamp = path / "bench.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("config") == cfg:
        return json.loads(stamp.read_text())["bytes"]
    shutil.rmtree(path, ignore_errors=True)
    start = time.perf_counter()
    total = write_mixtral_checkpoint(path, cfg, dtype="bfloat16", shard_bytes=shard_bytes)
    stamp.write_text(json.dumps({"config": cfg, "bytes": total}))
    print(f"wrote {total / 1e9:.2f} GB checkpoint in {time.perf_counter() - start:.1f} s", file=log or sys.stdout,
          flush=True)
    return total


def warm(path: Path) -> float:
    start, n = time.perf_counter(), 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return n / (time.perf_counter() - start) / 1e9


# The child: the converter with `colibri convert`'s defaults (float16 dense, int8 experts, no read-back),
# its summary as JSON on stdout, its own VmHWM on stderr (after fork+exec, ru_maxrss also counts this parent).
CHILD = ("import json, sys\n"
         "from colibri_format.convert.pipeline import convert\n"
         "summary = convert(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), resume=False)\n"
         "print(json.dumps(summary.to_dict()))\n"
         "sys.stderr.write([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n")


def run_convert(ckpt: Path, out: Path, workers: int) -> dict:
    args = [str(ckpt), str(out), str(workers)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {"user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime}
    if done.returncode != 0:
        raise SystemExit(f"conversion failed ({done.returncode}): {done.stderr[-3000:]}")
    summary = json.loads(done.stdout)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    hwm = int(done.stderr.rsplit("VmHWM:", 1)[1].split()[0]) * 1024
    return {"command": f"convert({str(ckpt)!r}, {str(out)!r}, workers={workers}, resume=False)", "wall_s": wall,
            "summary": summary, "peak_rss": rss, "vm_hwm": hwm, "cpu": cpu}


def expert_subset(ckpt: Path, budget_values: int) -> list[tuple[str, np.ndarray]]:
    """bf16 expert matrices (as stored, uint16 views) up to `budget_values` values."""
    out, total = [], 0
    with open_checkpoint(ckpt) as src:
        for name in src.tensor_names():
            if ".experts." in name and total < budget_values:
                view = src.native_view(name)
                out.append((name, np.array(view)))
                total += view.size
    return out


def time_quantizers(tensors: list[tuple[str, np.ndarray]], seconds: float) -> dict:
    import gguf

    res = {}
    for label, fn in (("gguf_q8_0", lambda w: gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)),
                      ("colibri_int8_row", lambda w: quantize_int8(w))):
        values, spent = 0, 0.0
        for _, bits in tensors:
            w = to_float32(bits)
            start = time.perf_counter()
            fn(w)
            spent += time.perf_counter() - start
            values += w.size
            if spent > seconds:
                break
        res[label] = {"values": values, "seconds": spent, "values_per_s": values / spent,
                      "source_gb_per_s": 2 * values / spent / 1e9}
    return res


def stage_costs(tensors: list[tuple[str, np.ndarray]], tmp: Path) -> dict:
    """Single-thread seconds per GB of bf16 source per streaming stage (CHUNK_ELEMENTS chunks, as the pipeline)."""
    import xxhash

    from colibri_format.convert.rows import CHUNK_ELEMENTS
    t = {"upcast": 0.0, "quantize": 0.0, "write_hash": 0.0}
    nbytes = 0
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        for _, bits in tensors[:8]:
            step = CHUNK_ELEMENTS // bits.shape[1]
            for r in range(0, bits.shape[0], step):
                chunk = bits[r:r + step]
                a = time.perf_counter()
                w = to_float32(chunk)
                b = time.perf_counter()
                q = quantize_int8(w)
                c = time.perf_counter()
                os.pwrite(fd, q.q, pos)
                xxhash.xxh3_64(q.q).intdigest()
                d = time.perf_counter()
                pos += q.q.nbytes
                t["upcast"] += b - a
                t["quantize"] += c - b
                t["write_hash"] += d - c
                nbytes += chunk.nbytes
    finally:
        os.close(fd)
        tmp.unlink(missing_ok=True)
    return {k: v / (nbytes / 1e9) for k, v in t.items()} | {"bytes": nbytes}


PROFILE_NAMES = {"_quantize_blocks": "int8 quantizer (NumPy blocks)", "to_float32": "bf16 -> f32 upcast",
                 # the compiled loops (convert/native.py) are ctypes calls, which cProfile counts in their caller
                 "quantize_into": "int8 quantizer (compiled loop, or NumPy's around its blocks)",
                 "posix.pwrite": "positional writes", "astype": "dense f32 -> f16 conversion",
                 "acquire": "waits on the worker threads", "madvise": "releasing mapped source pages",
                 "reduce": "int8 quantizer (NumPy blocks)"}  # its ufunc reductions


def profiled_conversion(ckpt: Path, out: Path, **options) -> tuple[float, dict]:
    """(wall seconds, pstats table) of one conversion under cProfile, its pieces run on the calling thread (so the
    profiler sees them); the output is removed afterwards. Also used by benchmarks/convert_piece_sizes.py."""
    import cProfile
    import pstats

    from colibri_format.convert import pipeline, schedule

    def sequential(items, work, workers, on_done):
        for item in items:
            on_done(work(item))

    real = schedule.run_bounded
    schedule.run_bounded = sequential
    prof = cProfile.Profile()
    start = time.perf_counter()
    try:
        prof.runcall(pipeline.convert, ckpt, out, workers=1, resume=False, **options)
    finally:
        schedule.run_bounded = real
        out.unlink(missing_ok=True)
    return time.perf_counter() - start, pstats.Stats(prof).stats


def profile_single_thread(ckpt: Path, out: Path) -> dict:
    """Where one single-thread conversion spends its time, by the named functions of PROFILE_NAMES."""
    wall, stats = profiled_conversion(ckpt, out)
    tottime = {}
    for (_, _, fname), row in stats.items():
        for key, label in PROFILE_NAMES.items():
            if fname == key or fname.endswith("." + key) or fname.endswith(f"'{key}' of 'numpy.ufunc' objects}}") \
                    or key in fname:
                tottime[label] = tottime.get(label, 0.0) + row[2]
    return {"wall_s": wall, "tottime_s": dict(sorted(tottime.items(), key=lambda kv: -kv[1]))}


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "numpy": np.__version__, "load_avg_1m_at_start": round(load[0], 2),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def _per_core(st: dict) -> float:
    return 1 / sum(st[k] for k in ("upcast", "quantize", "write_hash"))


def _run_rows(r: dict) -> list[str]:
    largest = r["largest_tensor_bytes"]
    budget = (2 * largest + (256 << 20)) / 2**20
    rows = ["| output on | wall time | source GB/s (wall) | GB/s (converter timer) | CPU time user + sys | "
            "source GB per CPU-second | peak RSS: ru_maxrss / VmHWM |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for run in r["runs"]:
        c, s = run["convert"], run["convert"]["summary"]
        cpu = c["cpu"]["user_s"] + c["cpu"]["sys_s"]
        rows.append(f"| {run['label']} | {c['wall_s']:.1f} s | {r['source_bytes'] / c['wall_s'] / 1e9:.2f} | "
                    f"{s['gb_per_s']:.2f} | {c['cpu']['user_s']:.1f} + {c['cpu']['sys_s']:.1f} s | "
                    f"{r['source_bytes'] / cpu / 1e9:.2f} | "
                    f"{c['peak_rss'] / 2**20:.0f} / {c['vm_hwm'] / 2**20:.0f} MiB |")
    s = r["runs"][0]["convert"]["summary"]
    return rows + ["", f"Output {s['bytes_out'] / 1e9:.2f} GB ({s['experts']} int8_row expert blobs, dense float16); "
                   f"quantization error relative to the row max: max {s['quant_error_max']:.2e}, mean "
                   f"{s['quant_error_mean']:.2e}. Memory budget (2 x largest source tensor {largest / 2**20:.0f} MiB "
                   f"+ 256 MiB) = {budget:.0f} MiB. Wall time includes interpreter start-up, planning, the batched "
                   "fsyncs and the rename (no read-back: `colibri convert`'s default).", ""]


def markdown(r: dict) -> str:
    q, st, m = r["quantizers"], r["stages"], r["machine"]
    g, ours = q["gguf_q8_0"], q["colibri_int8_row"]
    best = min((run["convert"] for run in r["runs"]), key=lambda c: c["wall_s"])
    e2e_values = r["source_bytes"] / 2 / best["wall_s"]
    lines = [
        SECTION, "",
        f"Measured {r['date']} on {m['nproc']} cores ({m['cpu']}), {m['mem_gb']} GiB RAM, Python {m['python']}, "
        f"NumPy {m['numpy']}; 1-minute load average at start {m['load_avg_1m_at_start']} (a shared machine: other "
        f"sessions' tests and benchmarks ran at the same time). Disk write speed (dd, fdatasync): "
        f"{r['disk_write_mb_s']:.0f} MB/s.", "",
        f"Command: `{r['bench_command']}`; each conversion: `{best['command']}` in a child process.", "",
        f"Checkpoint: synthetic bf16 Mixtral layout, hidden {r['config']['hidden_size']}, expert intermediate "
        f"{r['config']['intermediate_size']}, {r['config']['num_local_experts']} experts x "
        f"{r['config']['num_hidden_layers']} layers, vocab {r['config']['vocab_size']}: "
        f"{r['source_bytes'] / 1e9:.2f} GB in {r['shards']} shards, read once before converting "
        f"({r['warm_gb_per_s']:.1f} GB/s).", "",
        *_run_rows(r),
        f"Quantizer alone, one thread, the same expert tensors as float32 ({g['values'] / 1e6:.0f} M values for "
        f"gguf, {ours['values'] / 1e6:.0f} M for colibri):", "",
        "| quantizer | values/s | GB/s of bf16 source | vs gguf Q8_0 |", "| --- | --- | --- | --- |",
        f"| gguf-py 0.19 `quants.quantize(x, Q8_0)` | {g['values_per_s'] / 1e6:.1f} M | "
        f"{g['source_gb_per_s']:.3f} | 1x |",
        f"| colibri `quantize_int8` (per row) | {ours['values_per_s'] / 1e6:.1f} M | {ours['source_gb_per_s']:.3f} | "
        f"{ours['values_per_s'] / g['values_per_s']:.1f}x |",
        f"| colibri convert end to end, {r['workers']} workers, best run (wall) | {e2e_values / 1e6:.1f} M | "
        f"{2 * e2e_values / 1e9:.3f} | {e2e_values / g['values_per_s']:.1f}x |", "",
        "Single-thread cost of each streaming stage, seconds per GB of bf16 source (4 MB float32 chunks, data in "
        "memory): "
        f"upcast {st['upcast']:.2f}, quantize {st['quantize']:.2f}, write + XXH3 {st['write_hash']:.2f}; one core "
        f"therefore tops out near {_per_core(st):.2f} GB/s and {r['workers']} cores near "
        f"{r['workers'] * _per_core(st):.2f} GB/s.", "",
    ]
    if "profile" in r:
        p = r["profile"]
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in p["tottime_s"].items())
        lines += [f"cProfile of the whole conversion on one thread (output on {r['profile_dir']}): "
                  f"{p['wall_s']:.1f} s = {r['source_bytes'] / p['wall_s'] / 1e9:.2f} GB/s of source; self time: "
                  f"{parts}.", ""]
    return "\n".join(lines + [r["verdict"], ""])


def verdict(r: dict) -> str:
    best = min(run["convert"]["wall_s"] for run in r["runs"])
    gbps = r["source_bytes"] / best / 1e9
    st = r["stages"]
    share = st["quantize"] / sum(st[k] for k in ("upcast", "quantize", "write_hash"))
    disk_bound = r["disk_write_mb_s"] * 1e6 * r["source_bytes"] / r["runs"][0]["convert"]["summary"]["bytes_out"] / 1e9
    c = min((run["convert"] for run in r["runs"]), key=lambda c: c["wall_s"])
    per_cpu_s = r["source_bytes"] / (c["cpu"]["user_s"] + c["cpu"]["sys_s"]) / 1e9
    if gbps >= 1.0:
        return (f"Target (>= 1 GB/s of source on 2 cores, warm cache) met: {gbps:.2f} GB/s of wall time "
                f"({per_cpu_s:.2f} GB per CPU-second; cores probe after the runs: {r['cores_available']:.2f} of "
                f"{r['workers']} free). The converter is CPU-bound, so the figure moves with other load on the "
                f"cores; the int8 quantizer is {share:.0%} of the per-chunk work.")
    return (f"Target (>= 1 GB/s) missed here: best {gbps:.2f} GB/s of wall time. Measured causes: (1) the cores "
            f"were shared: the conversion used {c['cpu']['user_s'] + c['cpu']['sys_s']:.0f} CPU-seconds in "
            f"{c['wall_s']:.0f} s of wall time ({(c['cpu']['user_s'] + c['cpu']['sys_s']) / c['wall_s']:.2f} of "
            f"the {r['workers']} cores it asked for; load average {r['machine']['load_avg_1m_at_start']}; a probe "
            f"after the runs found {r['cores_available']:.2f} of {r['workers']} cores free: {r['workers']} copies "
            f"of one CPU loop took that much longer than one); per "
            f"CPU-second it converted {per_cpu_s:.2f} GB, i.e. about {r['workers'] * per_cpu_s:.2f} GB/s on "
            f"{r['workers']} idle cores; (2) inside that CPU time the int8 quantizer is {share:.0%} of the "
            f"per-chunk work measured on in-memory data (the profile line above has the whole conversion), "
            f"and kernel time (sys {c['cpu']['sys_s']:.0f} s: page-cache pages for the "
            f"{r['runs'][0]['convert']['summary']['bytes_out'] / 1e9:.1f} GB output and faults on the mapped "
            f"input; first-touch memory on this VM ran at {r['first_touch_gb_s']:.2f} GB/s against "
            f"{r['memcpy_gb_s']:.1f} GB/s once touched) is the rest; (3) on disk, the durable output (fsynced "
            f"before the rename) also waits for the disk: dd measured {r['disk_write_mb_s']:.0f} MB/s, about "
            f"{disk_bound:.2f} GB/s of source at this compression.")


def memory_speed() -> tuple[float, float]:
    """(first-touch GB/s, warm memcpy GB/s) of a 256 MiB copy: page-fault cost of this machine."""
    a = np.ones(1 << 28, np.uint8)
    start = time.perf_counter()
    b = a.copy()
    first = a.nbytes / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    np.copyto(b, a)
    return first, a.nbytes / (time.perf_counter() - start) / 1e9


_SPIN = ("import sys, time, numpy as np; a = np.random.default_rng(0).standard_normal(1 << 22, dtype=np.float32); "
         "t = time.perf_counter(); [np.rint(a * 1.5) for _ in range(int(sys.argv[1]))]; "
         "print(time.perf_counter() - t)")


def cores_available(n: int, loops: int = 150) -> float:
    """How many of n cores this benchmark really gets: the same CPU loop alone, then n copies at once."""
    def run(k: int) -> float:
        procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(loops)], stdout=subprocess.PIPE, text=True)
                 for _ in range(k)]
        return max(float(p.communicate()[0]) for p in procs)
    alone = min(run(1) for _ in range(3))
    together = min(run(n) for _ in range(3))
    return min(n, n * alone / together)


def disk_write_speed(directory: Path) -> float:
    path = directory / "dd.tmp"
    block = np.zeros(16 << 20, np.uint8)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(32):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()
    return 32 * block.nbytes / (time.perf_counter() - start) / 1e6


def write_doc(text: str) -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    current = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
    if SECTION in current:  # replace only our section, up to the next `## ` heading
        head, rest = current.split(SECTION, 1)
        nxt = rest.find("\n## ")
        current = head + (rest[nxt + 1:] if nxt >= 0 else "")
    doc.write_text(current.rstrip("\n") + "\n\n" + text)


def rewrite_doc(result_json: Path) -> None:
    """Regenerate the docs section from a saved result.json (no re-measuring)."""
    r = json.loads(result_json.read_text())
    r["verdict"] = verdict(r)
    write_doc(markdown(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/colibri-bench"))
    ap.add_argument("--gb", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quant-gb", type=float, default=1.0, help="bf16 GB of expert values for the quantizer race")
    ap.add_argument("--quant-seconds", type=float, default=20.0)
    ap.add_argument("--tmpfs", type=Path, action="append", default=[],
                    help="also convert with the output in this RAM folder (e.g. /dev/shm): CPU-bound figure")
    ap.add_argument("--profile", action="store_true", help="also cProfile a single-thread conversion")
    ap.add_argument("--doc", action="store_true", help="write the section of docs/benchmarks.md")
    ap.add_argument("--clean", action="store_true", help="delete the checkpoint and output at the end")
    ap.add_argument("--rewrite-doc", type=Path, help="only regenerate the docs section from this result.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the script: tiny dimensions in a temporary --dir, short budgets, no docs")
    args = ap.parse_args()
    if args.rewrite_doc:
        rewrite_doc(args.rewrite_doc)
        return
    if args.dry_run:
        if args.doc:
            raise SystemExit("--dry-run measures nothing worth documenting: drop --doc")
        with tempfile.TemporaryDirectory(prefix="colibri-convert-dry-") as tmp:
            args.dir, args.gb, args.quant_gb, args.quant_seconds = Path(tmp), 0.05, 0.01, 1.0
            run(args, TINY, spin_loops=5)
        return
    run(args, FULL)


def run(args, dims: dict, spin_loops: int = 150) -> None:
    cfg = bench_config(args.gb, dims)
    ckpt = args.dir / "ckpt"
    args.dir.mkdir(parents=True, exist_ok=True)
    r = {"date": dt.date.today().isoformat(), "machine": machine(), "config": cfg, "workers": args.workers,
         "bench_command": "PYTHONPATH=. python benchmarks/convert.py " + " ".join(sys.argv[1:])}
    r["source_bytes"] = ensure_checkpoint(ckpt, cfg)
    r["shards"] = len(list(ckpt.glob("*.safetensors")))
    r["largest_tensor_bytes"] = max(cfg["vocab_size"], cfg["intermediate_size"]) * cfg["hidden_size"] * 2
    r["disk_write_mb_s"] = disk_write_speed(args.dir)
    r["runs"] = []
    for label, out_dir in [("disk (" + str(args.dir) + ")", args.dir)] + [(f"tmpfs ({d})", d) for d in args.tmpfs]:
        r["warm_gb_per_s"] = warm(ckpt)
        out = Path(out_dir) / "colibri-bench-out.colibri"
        run = {"label": label, "convert": run_convert(ckpt, out, args.workers)}
        print(json.dumps(run, indent=1), flush=True)
        r["runs"].append(run)
        out.unlink(missing_ok=True)
    r["first_touch_gb_s"], r["memcpy_gb_s"] = memory_speed()  # after the children: keeps ru_maxrss theirs
    r["cores_available"] = cores_available(args.workers, spin_loops)
    subset = expert_subset(ckpt, int(args.quant_gb * 1e9 / 2))
    r["quantizers"] = time_quantizers(subset, args.quant_seconds)
    r["stages"] = stage_costs(subset, args.dir / "stage.tmp")
    del subset
    if args.profile:
        r["profile_dir"] = str(args.tmpfs[0] if args.tmpfs else args.dir)
        r["profile"] = profile_single_thread(ckpt, Path(r["profile_dir"]) / "colibri-bench-profile.colibri")
    r["verdict"] = verdict(r)
    (args.dir / "result.json").write_text(json.dumps(r, indent=1))
    text = markdown(r)
    print(text)
    if args.doc:
        write_doc(text)
    if args.clean:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

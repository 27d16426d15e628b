"""What `colibri convert` costs per source GB as the expert matrices shrink (project issue 20).

Run from the repository root (the benchmark imports the library, and benchmarks/convert.py's profiled run):

    PYTHONPATH=. .venv/bin/python benchmarks/convert_piece_sizes.py            # ~1.2 GB per shape + qwen3w
    PYTHONPATH=. .venv/bin/python benchmarks/convert_piece_sizes.py --gb 3 --repeats 3 --json
    PYTHONPATH=. .venv/bin/python benchmarks/convert_piece_sizes.py --dry-run  # tiny, a few seconds
    # before/after: an older tree's package converting the same checkpoints, each run interleaved with ours
    git archive e94380a | tar -x -C /tmp/before
    PYTHONPATH=. .venv/bin/python benchmarks/convert_piece_sizes.py --gb 3 --repeats 3 --baseline /tmp/before

For each shape (synthetic bf16 Mixtral-layout checkpoints, written once into --dir by
`colibri_format.synthetic.write_mixtral_checkpoint` and reused):

  small   hidden 2048, expert FFN 768    (3.1 MB matrices, the Qwen3-30B-A3B width, up to 128 experts/layer),
          vocab 1,024, about --gb source GB
  medium  hidden 4096, expert FFN 3584   (29 MB matrices), about --gb source GB
  large   hidden 4096, expert FFN 14336  (117 MB matrices, Mixtral-8x7B), about --gb source GB
  qwen3w  the Qwen3-30B-A3B widths whole: hidden 2048, 128 experts of 768, vocab 151,936 (embedding and
          lm_head: a third of the bytes), 16/4 heads of 128, top-8, --qwen3-layers layers (default 2: 3.7 GB)

1. reads every shard once (warm page cache);
2. converts in a child process: `colibri_format.convert.pipeline.convert(ckpt, out, quantize="expert",
   workers=N, resume=False)` (what `colibri convert --quantize expert --workers N --restart` runs), output in
   --out-dir (default /dev/shm when it exists; the previous output is removed before each run); --repeats
   runs, the best wall time is reported (and the median); with --baseline as many runs, interleaved, with
   another tree's package; with --quiet-wait each run first waits for idle CPUs; with --sha256 every output is
   hashed and all runs of all trees must have written the same bytes (exit status 3 otherwise). CPU user/sys
   come from `os.wait4` of that child (the table gives the best run's and the median of all runs), peak RSS from
   the child's own VmHWM, write syscalls from its /proc/self/io (`syscw`: every write, pwrite and journal
   append), other processes' CPU time from /proc/stat and the 1-minute load average at each run's start;
3. with --cpu-stages, one more conversion (this tree, in a child, same workers) with the CPU time (user + sys,
   `time.thread_time`) of each stage summed over all threads: source reads, source hash, quantize, dense cast,
   output hash, writes, verify re-read, and the rest of the conversion's CPU; start-up (imports) apart;
4. one in-process conversion under cProfile with the pieces run on the calling thread, self time
   aggregated to stages (builtins and library-external frames are charged to the colibri function that
   called them): reads/casts (source reads, bf16 upcast, dense dtype casts), quantize, checksum, writes,
   fsync/journal, other.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from colibri_format.synthetic import mixtral_checkpoint_config

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # name: (hidden, expert FFN, most experts per layer, heads, kv heads)
    "small": (2048, 768, 128, 16, 4),
    "medium": (4096, 3584, 64, 32, 8),
    "large": (4096, 14336, 8, 32, 8),
    "qwen3w": (2048, 768, 128, 16, 4),
}
TINY = {"small": (256, 96, 16, 4, 2), "medium": (256, 384, 8, 4, 2), "large": (256, 1536, 4, 4, 2),
        "qwen3w": (256, 96, 16, 4, 2)}
QWEN3_VOCAB, QWEN3_TOP_K = 151_936, 8
STAGES = ("reads/casts", "quantize", "checksum", "writes", "fsync/journal", "other")

CHILD = ("import json, sys\n"
         "from colibri_format.convert.pipeline import convert\n"
         "s = convert(sys.argv[1], sys.argv[2], quantize='expert', workers=int(sys.argv[3]), resume=False,\n"
         "            quant_bits=int(sys.argv[4]), verify=sys.argv[5] == '1')\n"
         "print(json.dumps(s.to_dict()))\n"
         "sys.stderr.write([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
         "sys.stderr.write([l for l in open('/proc/self/io') if l.startswith('syscw')][0])\n")


# --cpu-stages: one more conversion in a child, same call and workers, with each stage's CPU time (user + sys of the
# thread that ran it, time.thread_time) summed over all threads; "rest" is the rest of the conversion's CPU (planning,
# per-piece and per-chunk Python, thread hand-offs, journal, finalize), "start-up" the interpreter and imports.
CPU_STAGES = ("source reads", "source hash", "quantize", "dense cast", "output hash", "writes", "verify re-read")
CHILD_STAGES = ("import json, resource, sys, threading, time\n"
                "from colibri_format import writer as W\n"
                "from colibri_format.convert import emit as E, rows as R, safetensors_file as F\n"
                "from colibri_format.convert.pipeline import convert\n"
                "acc, lock = {}, threading.Lock()\n"
                "def wrap(owner, name, stage):\n"
                "    f = getattr(owner, name)\n"
                "    def timed(*a, **k):\n"
                "        t = time.thread_time()\n"
                "        try:\n"
                "            return f(*a, **k)\n"
                "        finally:\n"
                "            d = time.thread_time() - t\n"
                "            with lock:\n"
                "                acc[stage] = acc.get(stage, 0.0) + d\n"
                "    setattr(owner, name, timed)\n"
                "wrap(F.SafetensorsFile, 'read_at', 'source reads')\n"
                "wrap(R.SourceHash, 'update', 'source hash')\n"
                "wrap(E, 'quantize_into', 'quantize')\n"
                "wrap(E, 'quantize_int4_into', 'quantize')\n"
                "wrap(E, 'bf16_to_f16', 'dense cast')\n"
                "wrap(E, '_stored_chunk', 'dense cast')\n"
                "wrap(W.PieceStream, 'commit', 'output hash')\n"
                "wrap(W, 'pwrite_all', 'writes')\n"
                "wrap(W.ColibriWriter, 'checksum_on_disk', 'verify re-read')\n"
                "t1 = resource.getrusage(resource.RUSAGE_SELF)\n"
                "s = convert(sys.argv[1], sys.argv[2], quantize='expert', workers=int(sys.argv[3]), resume=False,\n"
                "            quant_bits=int(sys.argv[4]), verify=sys.argv[5] == '1')\n"
                "t2 = resource.getrusage(resource.RUSAGE_SELF)\n"
                "cpu = lambda a, b: (b.ru_utime - a.ru_utime) + (b.ru_stime - a.ru_stime)\n"
                "print(json.dumps({'stages_s': acc, 'convert_cpu_s': cpu(t1, t2),\n"
                "                  'convert_user_s': t2.ru_utime - t1.ru_utime,\n"
                "                  'convert_sys_s': t2.ru_stime - t1.ru_stime,\n"
                "                  'startup_cpu_s': t1.ru_utime + t1.ru_stime, 'source_bytes': s.bytes_in}))\n")


def cpu_stage_run(ckpt: Path, out: Path, workers: int, quant_bits: int = 8, verify: bool = True) -> dict:
    """The --cpu-stages conversion (this tree), in a child; its output is removed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD_STAGES, str(ckpt.resolve()), str(out.resolve()),
                               str(workers), str(quant_bits), str(int(verify))], env=env, cwd=ROOT,
                              capture_output=True, text=True)
    finally:
        out.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise SystemExit(f"conversion failed ({proc.returncode}): {proc.stderr[-3000:]}")
    res = json.loads(proc.stdout)
    res["stages_s"]["rest"] = res["convert_cpu_s"] - sum(res["stages_s"].values())
    return res


def cpu_stage_line(name: str, res: dict) -> str:
    gb = res["source_bytes"] / 1e9
    parts = " / ".join(f"{res['stages_s'].get(k, 0.0) / gb:.3f}" for k in (*CPU_STAGES, "rest"))
    return (f"| {name} | {res['convert_user_s'] / gb:.2f} + {res['convert_sys_s'] / gb:.2f} | {parts} | "
            f"{res['startup_cpu_s']:.2f} s |")


def shape_config(dims: tuple, gb: float, vocab: int) -> dict:
    """Mixtral config of about `gb` source GB of experts with these dimensions."""
    hidden, inter, most, heads, kv = dims
    expert_bytes = 3 * hidden * inter * 2
    total = max(2, round(gb * 1e9 / expert_bytes))
    layers = -(-total // most)
    experts = max(2, round(total / layers))
    return mixtral_checkpoint_config(vocab=vocab, hidden=hidden, layers=layers, experts=experts, inter=inter,
                                     heads=heads, kv_heads=kv)


def qwen3_config(dims: tuple, layers: int, vocab: int) -> dict:
    """The Qwen3-30B-A3B widths (all 128 experts per layer, the full vocabulary) in the Mixtral layout."""
    hidden, inter, most, heads, kv = dims
    return mixtral_checkpoint_config(vocab=vocab, hidden=hidden, layers=layers, experts=most, inter=inter,
                                     heads=heads, kv_heads=kv, top_k=QWEN3_TOP_K)


def warm(path: Path) -> None:
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def cpu_ticks() -> tuple[int, int]:
    """(busy, all) jiffies of the whole machine, from /proc/stat (0, 0 where there is none)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def wait_quiet(limit_s: float, busy_below: float = 0.08) -> float:
    """Wait (at most `limit_s`) until the machine's CPUs are at least 92% idle over 3 s; the busy share seen last."""
    end, busy = time.monotonic() + limit_s, 1.0
    while time.monotonic() < end:
        b0, a0 = cpu_ticks()
        time.sleep(3)
        b1, a1 = cpu_ticks()
        busy = (b1 - b0) / max(1, a1 - a0)
        if busy < busy_below:
            break
    return busy


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def run_child(ckpt: Path, out: Path, workers: int, root: Path = ROOT, sha256: bool = False,
              quant_bits: int = 8, verify: bool = True) -> dict:
    """One conversion in a child process whose `colibri_format` is the one under `root`; with `sha256`, the
    output's SHA-256 is taken (after the child's figures) before the output is removed."""
    load1 = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        busy0, _ = cpu_ticks()
        start = time.perf_counter()
        # run in `root`: `python -c` puts the working directory first on sys.path, before PYTHONPATH
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ckpt.resolve()), str(out.resolve()), str(workers),
                                 str(quant_bits), str(int(verify))],
                                env=env, cwd=root, stdout=so, stderr=se, text=True)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        busy1, _ = cpu_ticks()
        proc.returncode = os.waitstatus_to_exitcode(status)
        so.seek(0), se.seek(0)
        stdout, stderr = so.read(), se.read()
    digest = file_sha256(out) if sha256 and proc.returncode == 0 else None
    out.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise SystemExit(f"conversion failed ({proc.returncode}): {stderr[-3000:]}")
    # CPU time other processes took from the machine's cores while the conversion ran
    others = max(0.0, (busy1 - busy0) / hz - ru.ru_utime - ru.ru_stime)
    return {"wall_s": wall, "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "others_cpu_s": others,
            "load_avg_1m": round(load1, 2), "vm_hwm": int(stderr.rsplit("VmHWM:", 1)[1].split()[0]) * 1024,
            "write_syscalls": int(stderr.rsplit("syscw:", 1)[1].split()[0]), "summary": json.loads(stdout),
            **({"sha256": digest} if digest else {})}


# Stage of a colibri_format function, by (file, function) -- read off convert/, writer.py, fsutil.py, dtypes.py.
def _colibri_stage(path: str, func: str) -> str | None:
    p = path.replace(os.sep, "/")
    if "/colibri_format/" not in p:
        return None
    mod = p.rsplit("/colibri_format/", 1)[1]
    if mod == "convert/quantize.py":
        return "quantize"
    if mod in ("dtypes.py", "convert/safetensors_file.py", "convert/source.py", "convert/cast.py") or \
            (mod == "convert/rows.py" and func in ("iter_chunks", "iter_span_chunks", "release_pages",
                                                   "_backing_map", "read", "_read_buffer")):
        return "reads/casts"
    if mod == "convert/verify.py" or (mod == "convert/rows.py" and func in ("update", "intdigest",
                                                                             "source_digest")) \
            or func == "checksum_on_disk":
        return "checksum"
    if mod == "fsutil.py" and func == "pwrite_all" or func in ("_write_at", "put", "pad_to", "flush", "reserve",
                                                               "commit", "room"):
        return "writes"
    if mod in ("convert/journal.py", "convert/schedule.py") or func in ("fsync_fd", "fsync_dir", "sync",
                                                                       "atomic_replace"):
        return "fsync/journal" if func != "run_bounded" else None
    return "other" if func not in ("convert", "_convert_locked", "_convert_pieces", "_do_piece", "_do_run", "<lambda>",
                                   "sequential", "done") else None


def _builtin_stage(name: str) -> str | None:
    if "xxhash" in name or "xxh3" in name:
        return "checksum"
    if "pwrite" in name:
        return "writes"
    if "fsync" in name:
        return "fsync/journal"
    if "madvise" in name:
        return "reads/casts"
    return None


def stage_profile(stats: dict) -> dict[str, float]:
    """Self time per stage: a frame outside colibri_format (NumPy, builtins) is charged to its callers'
    stages in proportion to the time each caller spent in it, recursively."""
    memo: dict = {}

    def stages_of(func: tuple, depth: int = 0) -> dict[str, float]:  # fractions summing to 1
        if func in memo:
            return memo[func]
        path, _, name = func
        own = _builtin_stage(name) if path == "~" else _colibri_stage(path, name)
        if own is not None:
            res = {own: 1.0}
        else:
            callers = stats[func][4] if func in stats else {}
            weights = {c: v[2] + 1e-12 for c, v in callers.items() if c != func}
            total = sum(weights.values())
            res = {}
            if not weights or depth > 40:
                res = {"other": 1.0}
            else:
                memo[func] = {"other": 1.0}  # cycle guard
                for c, w in weights.items():
                    for st, frac in stages_of(c, depth + 1).items():
                        res[st] = res.get(st, 0.0) + frac * w / total
        memo[func] = res
        return res

    out = dict.fromkeys(STAGES, 0.0)
    for func, row in stats.items():
        for st, frac in stages_of(func).items():
            out[st] += row[2] * frac
    return out


def profile_run(ckpt: Path, out: Path) -> dict:
    from benchmarks.convert import profiled_conversion   # the same single-thread profiled run as convert.py

    wall, stats = profiled_conversion(ckpt, out, quantize="expert")
    return {"wall_s": wall, "stages_s": stage_profile(stats)}


def _median(values) -> float:
    v = sorted(values)
    return v[len(v) // 2] if v else float("nan")


def _loads(runs: list[dict]) -> str:
    loads = [x["load_avg_1m"] for x in runs if "load_avg_1m" in x]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


def table(results: list[dict]) -> str:
    rows = ["| shape | expert matrix | source GB | wall s | source GB/s (best / median wall, converter timer) | "
            "CPU user / sys s per GB | CPU s per GB | CPU user / sys s per GB, median of runs | others' CPU s | "
            "load avg 1 min at runs | peak RSS | write syscalls per GB | "
            "profile (1 thread): s per GB " + " / ".join(STAGES) + " |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        gb, c, p = r["source_bytes"] / 1e9, r["best"], r["profile"]
        prof = ("not run" if p is None else
                " / ".join(f"{p['stages_s'][s] / gb:.2f}" for s in STAGES) + f" (total {p['wall_s'] / gb:.2f})")
        rows.append(f"| {r['shape']} | {r['hidden']}x{r['inter']} ({r['matrix_bytes'] / 1e6:.1f} MB), "
                    f"{r['experts']} experts x {r['layers']} layers, vocab {r['vocab']:,} | {gb:.2f} | "
                    f"{c['wall_s']:.2f} | {gb / c['wall_s']:.2f} / {gb / r['median_wall_s']:.2f}, "
                    f"{c['summary']['gb_per_s']:.2f} | "
                    f"{c['user_s'] / gb:.2f} / {c['sys_s'] / gb:.2f} | {(c['user_s'] + c['sys_s']) / gb:.2f} | "
                    f"{_median(x['user_s'] for x in r['runs']) / gb:.2f} / "
                    f"{_median(x['sys_s'] for x in r['runs']) / gb:.2f} | "
                    f"{c.get('others_cpu_s', float('nan')):.1f} | {_loads(r['runs'])} | "
                    f"{c['vm_hwm'] / 2**20:.0f} MiB | "
                    f"{c['write_syscalls'] / gb:.0f} | {prof} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "colibri-piece-bench")
    ap.add_argument("--gb", type=float, default=1.2, help="source GB per shape (default 1.2)")
    ap.add_argument("--shapes", default="small,medium,large,qwen3w")
    ap.add_argument("--qwen3-layers", type=int, default=2, help="layers of the qwen3w checkpoint (default 2)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where the output goes (default /dev/shm when it exists, else --dir)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--quant-bits", type=int, default=8, choices=(8, 4),
                    help="int8_row experts (default) or int4_group (group 32), as `colibri convert --quant-bits`")
    ap.add_argument("--repeats", type=int, default=2, help="child conversions per shape; the best is reported")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--cpu-stages", action="store_true",
                    help="one more conversion per shape (this tree, in a child, same workers) with the CPU time of "
                         "each stage summed over threads: " + ", ".join(CPU_STAGES) + ", rest")
    ap.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                    help="before each run, wait up to S seconds for the machine's CPUs to be >= 92%% idle (shared "
                         "machines: other processes' CPU time during each run is reported either way)")
    ap.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                    help="also convert with the colibri_format package under DIR (an older checkout), each run "
                         "interleaved with this tree's; its rows are marked (baseline) and have no profile")
    ap.add_argument("--sha256", action="store_true",
                    help="hash every output (outside the child's figures) and check that all runs of all trees wrote "
                         "the same bytes (exit status 3 when they differ)")
    ap.add_argument("--verify", action=argparse.BooleanOptionalAction, default=False,
                    help="convert with verify=True (`colibri convert --verify`: every piece read back from the file "
                         "and re-hashed before the rename); the default, as the CLI's, does not read back")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    ap.add_argument("--clean", action="store_true", help="delete the checkpoints at the end")
    ap.add_argument("--dry-run", action="store_true", help="tiny dimensions in a temporary --dir")
    args = ap.parse_args()
    shapes, vocab, qwen3_vocab, gb = SHAPES, 1024, QWEN3_VOCAB, args.gb
    tmp = None
    if args.dry_run:
        tmp = tempfile.TemporaryDirectory()
        shapes, vocab, qwen3_vocab, gb, args.dir, args.repeats = TINY, 64, 512, 0.003, Path(tmp.name), 1
        args.out_dir = None
    out_dir = args.out_dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else args.dir)
    load = os.getloadavg()
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "nproc": os.cpu_count(),
            "load_avg_at_start": [round(x, 2) for x in load], "workers": args.workers, "verify": args.verify, "gb": gb,
            "quant_bits": args.quant_bits,
            "output_dir": str(out_dir), "command": " ".join(["benchmarks/convert_piece_sizes.py", *sys.argv[1:]])}
    results = []
    mismatched = False
    try:
        for name in args.shapes.split(","):
            dims = shapes[name]
            cfg = (qwen3_config(dims, args.qwen3_layers, qwen3_vocab) if name == "qwen3w"
                   else shape_config(dims, gb, vocab))
            ckpt = args.dir / name
            print(f"{name}: hidden {dims[0]}, FFN {dims[1]}, {cfg['num_local_experts']} experts x "
                  f"{cfg['num_hidden_layers']} layers, vocab {cfg['vocab_size']}", file=sys.stderr, flush=True)
            from benchmarks.convert import ensure_checkpoint   # the same kept checkpoint as convert.py

            total = ensure_checkpoint(ckpt, cfg, shard_bytes=2 << 30, log=sys.stderr)
            out = out_dir / f"colibri-piece-bench-{os.getpid()}-{name}.colibri"
            trees = [("", ROOT)] + ([(" (baseline)", args.baseline.resolve())] if args.baseline else [])
            runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
            for _ in range(args.repeats):
                for label, root in trees:
                    out.unlink(missing_ok=True)
                    warm(ckpt)
                    if args.quiet_wait > 0:
                        wait_quiet(args.quiet_wait)
                        warm(ckpt)  # a quiet wait may outlast the page cache's patience
                    runs[label].append(run_child(ckpt, out, args.workers, root, sha256=args.sha256,
                                                 quant_bits=args.quant_bits, verify=args.verify))
                    print(f"  convert{label}: {runs[label][-1]['wall_s']:.2f} s "
                          f"(others' CPU {runs[label][-1]['others_cpu_s']:.1f} s)", file=sys.stderr, flush=True)
            if args.sha256:
                digests = {x["sha256"] for label, _ in trees for x in runs[label]}
                print(f"  sha256: {'identical' if len(digests) == 1 else 'DIFFERENT'} "
                      f"({', '.join(sorted(d[:16] for d in digests))})", file=sys.stderr, flush=True)
                mismatched = mismatched or len(digests) != 1
            for label, _ in trees:
                walls = sorted(x["wall_s"] for x in runs[label])
                r = {"shape": name + label, "hidden": dims[0], "inter": dims[1],
                     "experts": cfg["num_local_experts"], "vocab": cfg["vocab_size"],
                     "layers": cfg["num_hidden_layers"], "matrix_bytes": dims[0] * dims[1] * 2,
                     "source_bytes": total, "runs": runs[label], "best": min(runs[label], key=lambda x: x["wall_s"]),
                     "median_wall_s": walls[len(walls) // 2]}
                if args.cpu_stages and not label:
                    warm(ckpt)
                    r["cpu_stages"] = cpu_stage_run(ckpt, out, args.workers, args.quant_bits, args.verify)
                    print("  " + cpu_stage_line(name, r["cpu_stages"]), file=sys.stderr, flush=True)
                if not args.no_profile and not label:
                    warm(ckpt)
                    r["profile"] = profile_run(ckpt, out)
                    print(f"  profile: {r['profile']['wall_s']:.2f} s", file=sys.stderr, flush=True)
                else:
                    r["profile"] = None          # --no-profile, or a baseline tree's rows
                results.append(r)
            if args.clean:
                shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    head = (f"{meta['date']}, nproc {meta['nproc']}, load average at start {meta['load_avg_at_start']}, "
              f"workers {args.workers}, int{args.quant_bits} experts, output on {out_dir}"
              f"{', read back (--verify)' if args.verify else ''}")
    stage_rows = [cpu_stage_line(r["shape"], r["cpu_stages"]) for r in results if "cpu_stages" in r]
    if stage_rows:
        head_stages = ("| shape | CPU user + sys s per GB | CPU s per GB: " + " / ".join((*CPU_STAGES, "rest")) +
                       " | start-up CPU |\n| --- | ---: | --- | ---: |\n")
        stage_table = "\n\n" + head_stages + "\n".join(stage_rows)
    else:
        stage_table = ""
    if args.json:  # the table goes to stderr, the JSON alone to stdout
        print(head + "\n" + table(results) + stage_table, file=sys.stderr)
        print(json.dumps({"machine": meta, "results": results}, indent=1))
    else:
        print(head + "\n" + table(results) + stage_table)
    if mismatched:
        raise SystemExit(3)


if __name__ == "__main__":
    main()

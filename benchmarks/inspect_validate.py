"""Benchmark `colibri inspect` latency and `colibri validate` throughput.

Run from the repository root (the benchmark imports the library, nothing else):

    PYTHONPATH=. python benchmarks/inspect_validate.py [--dir /tmp] [--repeats 21] [--command-repeats 7] [--json]
    PYTHONPATH=. python benchmarks/inspect_validate.py --dry-run     # the small files only, a few repeats

* inspect latency, median of N: `inspect_file()` in process, and the user's command
  `python -m colibri_format inspect --json` as a child process (includes interpreter start-up), on a small
  file (~50 KB) and on a large file with
  48 MoE layers x 128 experts (6,144 blobs; hidden 1024, expert_intermediate 256, int8_row, float16 dense:
  about 5.1 GB, written with `reuse_expert=True`), and on a file with the same tables but tiny weights
  (~25 MB). Inspect reads the header and tables only, so its time follows the number of table entries,
  not the bytes of weights.
* validate throughput on the large file with a warm page cache (the file is read once first), beside the
  raw speed of XXH3-64 over the same bytes (the mapped file hashed in 64 MiB chunks) in the same run.

The large file is deleted at the end (unless --keep). --dry-run checks the script: only the small file and
the large tables with tiny weights (that one is then the validated file), 3 repeats of each measure.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import xxhash

from colibri_format import spec as S
from colibri_format.inspect import inspect_file, validate_file
from colibri_format.synthetic import synthetic_model, write_synthetic

_ROOT = Path(__file__).resolve().parents[1]

CHUNK = 64 << 20
LARGE = dict(vocab=1024, hidden=1024, layers=48, heads=8, kv_heads=1, experts=128, top_k=8, expert_inter=256)
MEDIUM = dict(LARGE, layers=12, experts=32)
# The large file's tables (48 x 128 blobs, 339 dense tensors) with tiny weights: ~25 MB instead of ~5 GB.
SAME_TABLES = dict(LARGE, vocab=64, hidden=64, heads=4, expert_inter=16)
SMALL = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, expert_inter=48)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_once(path: Path) -> float:
    """Pull the whole file into the page cache; returns seconds."""
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(CHUNK)
        while fh.readinto(buf):
            pass
    return time.perf_counter() - t


def raw_xxh3(path: Path) -> float:
    """Seconds to hash the whole mapped file with XXH3-64 in 64 MiB chunks."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        t = time.perf_counter()
        h = xxhash.xxh3_64()
        for pos in range(0, len(mm), CHUNK):
            h.update(view[pos:pos + CHUNK])
        h.intdigest()
        seconds = time.perf_counter() - t
        view.release()
    return seconds


def inspect_command(path: Path) -> None:
    """`python -m colibri_format inspect --json FILE` as a user runs it: a child process, from the checkout."""
    subprocess.run([sys.executable, "-m", "colibri_format", "inspect", "--json", str(path)], check=True,
                   stdout=subprocess.DEVNULL, cwd=_ROOT)


def machine() -> dict:
    model = platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                     model)
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "xxhash": xxhash.VERSION, "loadavg_1min_at_start": round(os.getloadavg()[0], 2)}


def run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="colibri-bench-", dir=args.dir))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "files": {}}
    try:
        files = {}
        sets = ((("small", SMALL), ("large-tables-tiny-weights", SAME_TABLES)) if args.dry_run else
                (("small", SMALL), ("medium", MEDIUM), ("large-tables-tiny-weights", SAME_TABLES), ("large", LARGE)))
        for name, model_kw in sets:
            path = workdir / f"{name}.colibri"
            t = time.perf_counter()
            write_synthetic(path, synthetic_model(**model_kw), expert_format=S.ExpertFormat.INT8_ROW,
                            dense_dtype=S.DType.F16, reuse_expert=True, seed=0)
            files[name] = path
            info = inspect_file(path)
            result["files"][name] = {
                "model": model_kw, "bytes": path.stat().st_size, "write_s": round(time.perf_counter() - t, 2),
                "blobs": len(info["experts"]["entries"]), "blob_size": info["experts"]["blob_size"],
                "dense_tensors": len(info["dense_tensors"])}
        for name, path in files.items():
            read_once(path)
            r = result["files"][name]
            r["inspect_ms"] = round(1e3 * median_time(lambda: inspect_file(path), args.repeats), 3)
            r["command_inspect_ms"] = round(1e3 * median_time(lambda: inspect_command(path), args.command_repeats), 1)
        big = files[sets[-1][0]]
        size = big.stat().st_size
        read_s = read_once(big)
        validate_runs, hash_runs = [], []
        for _ in range(args.validate_repeats):
            report = validate_file(big)
            assert report.valid, report.faults
            validate_runs.append(report.seconds)
            hash_runs.append(raw_xxh3(big))
        v, h = statistics.median(validate_runs), statistics.median(hash_runs)
        result["loadavg_1min_at_end"] = round(os.getloadavg()[0], 2)
        result["validate"] = {"file": sets[-1][0], "bytes": size, "warm_read_s": round(read_s, 2), "runs": args.validate_repeats,
                              "validate_s": round(v, 3), "validate_gb_s": round(size / v / 1e9, 2),
                              "raw_xxh3_s": round(h, 3), "raw_xxh3_gb_s": round(size / h / 1e9, 2),
                              "validate_over_raw": round(h / v, 3)}
    finally:
        if not args.keep:
            for p in workdir.iterdir():
                p.unlink()
            workdir.rmdir()
    return result


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


def markdown(r: dict, command: str) -> str:
    m, f, v = r["machine"], r["files"], r["validate"]
    lines = [
        "## inspect and validate", "",
        f"Date {r['date']}; machine: `nproc` = {m['nproc']}, `lscpu` model name: {m['cpu']}; Python {m['python']}, "
        f"xxhash {m['xxhash']}; 1-minute load average {m['loadavg_1min_at_start']} at the start and "
        f"{r['loadavg_1min_at_end']} at the end (other jobs shared the machine). Command: `{command}`.", "",
        "Files: synthetic, int8_row experts, float16 dense tensors, one random blob reused in every slot "
        "(`write_synthetic(..., reuse_expert=True)`).", "",
        "| file | model | size | blobs | dense tensors | `inspect_file` (median) | `python -m colibri_format inspect --json` (median) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, x in f.items():
        mk = x["model"]
        desc = (f"{mk['layers']} MoE layers x {mk['experts']} experts, hidden {mk['hidden']}, "
                f"expert_inter {mk['expert_inter']}")
        lines.append(f"| {name} | {desc} | {_size(x['bytes'])} | {x['blobs']:,} | {x['dense_tensors']} | "
                     f"{x['inspect_ms']:.2f} ms | {x['command_inspect_ms']:.0f} ms |")
    lines += [
        "",
        f"Validate, {v.get('file', 'large')} file ({v['bytes'] / 1e9:.2f} GB), warm page cache, median of "
        f"{v['runs']}:", "",
        "| what | seconds | GB/s |", "| --- | ---: | ---: |",
        f"| `validate_file` (every checksum and every must-be-zero byte) | {v['validate_s']:.3f} | "
        f"{v['validate_gb_s']:.2f} |",
        f"| raw XXH3-64 over the mapped file, 64 MiB chunks | {v['raw_xxh3_s']:.3f} | {v['raw_xxh3_gb_s']:.2f} |",
        "", f"validate / raw hash speed: **{v['validate_over_raw']:.2f}**.", "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write the files (default: the temp dir)")
    parser.add_argument("--repeats", type=int, default=21, help="inspect_file repetitions per file")
    parser.add_argument("--command-repeats", "--cli-repeats", type=int, default=7, dest="command_repeats",
                        help="repetitions per file of the `python -m colibri_format inspect` child process")
    parser.add_argument("--validate-repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="small files only, 3 repeats: checks the script")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.repeats = args.command_repeats = args.validate_repeats = 3
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(markdown(r, "PYTHONPATH=. python benchmarks/inspect_validate.py "
                       + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

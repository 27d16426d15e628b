"""Mutation fuzzer for the `.colibri` reader, inspector and validator (no extra dependencies).

    python -m tests.fuzz.fuzz_format --iterations 100000 --seed 1 [--json]
    python -m tests.fuzz.fuzz_format --replay tests/fuzz/crashes/*.colibri

Each input is a seed file (small valid synthetic files of every expert format) after one to three
mutations: bit flips, byte sets, boundary values written into fields found through the spec's field
tables, truncation and extension, splices (within a file and between seeds), chunk insertion/deletion, and
type-confused metadata values. Most mutations are then re-sealed (section checksums, and sometimes tensor
and blob checksums, recomputed) so the input gets past the checksums to the deeper checks.

Every input goes through `load_tables`, `colibri_format.open` plus reading one dense tensor and one expert
(verified and unverified), `inspect_file` and `validate_file`. A ColibriFormatError is the expected outcome
and is counted by class; any other exception (or a hang past --timeout seconds) is a crash: it is printed,
its input saved to tests/fuzz/crashes/, and the script exits 1. Memory is capped with RLIMIT_AS (4 GiB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path


import numpy as np

import colibri_format
from colibri_format import errors as E
from colibri_format import spec as S
from colibri_format.inspect import inspect_file, validate_file
from colibri_format.reader import load_tables
from tests.spec import craft

CRASH_DIR = Path(__file__).resolve().parent / "crashes"
MEMORY_LIMIT = 4 << 30


class Hang(Exception):
    pass


# --- seeds ---------------------------------------------------------------------------------------------------
def make_seeds() -> list[bytes]:
    small = craft.SMALL_MODEL
    two = dict(small, layers=2, experts=3, top_k=2)
    specs = [
        (small, dict(expert_format=S.ExpertFormat.INT8_ROW, dense_dtype=S.DType.F16)),
        (dict(small, hidden=32, expert_inter=32), dict(expert_format=S.ExpertFormat.INT8_GROUP, group_size=16,
                                                        dense_dtype=S.DType.F32)),
        (craft.TINY_MODEL, dict(expert_format=S.ExpertFormat.F32, dense_dtype=S.DType.BF16)),
        (dict(two, layers=3, dense_layers=(1,), shared=16, qk_norm="full", tie=False),
         dict(expert_format=S.ExpertFormat.BF16, dense_dtype=S.DType.F16)),
        (two, dict(expert_format=S.ExpertFormat.F16, dense_dtype=S.DType.F32)),
        (craft.SMALL_4BIT_MODEL, dict(expert_format=S.ExpertFormat.INT4_GROUP, group_size=32, dense_dtype=S.DType.F16)),
        (dict(two, hidden=32, expert_inter=64), dict(expert_format=S.ExpertFormat.MXFP4, group_size=32,
                                                     dense_dtype=S.DType.BF16)),
    ]
    return [bytes(craft.valid_bytes(m, seed=i, **kw)) for i, (m, kw) in enumerate(specs)]


# --- mutations -------------------------------------------------------------------------------------------------
FIELDS = craft.numeric_fields()
JSON_VALUES = [None, True, False, 0, 1, -1, 2**31 - 1, 2**32, 2**63, 2**64, -2**63, 10**30, 1e308, -0.0, 1e-320, 0.5,
               "", "8", "silu", "int8_row", "int4_group", "mxfp4", "float16", "\u0000", "\ud800", "x" * 300, [], [0], [1, 0], [[[[]]]],
               {}, {"type": "default"}, list(range(40))]


def _header(buf) -> S.Header | None:
    return craft.header_of(buf) if len(buf) >= S.HEADER_SIZE else None


def m_bitflip(rng, buf, seeds):
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        if buf:
            bit = rng.randrange(len(buf) * 8)
            buf[bit >> 3] ^= 1 << (bit & 7)
    return buf


def m_byteset(rng, buf, seeds):
    for _ in range(rng.randint(1, 4)):
        if buf:
            buf[rng.randrange(len(buf))] = rng.choice((0, 0xFF, 0x7F, 0x80, 1, rng.randrange(256)))
    return buf


def m_field(rng, buf, seeds):
    h = _header(buf)
    if h is None:
        return buf
    table, name = rng.choice(FIELDS)
    count = {"header": 1, "dense": min(h.num_dense_tensors, 1 << 16), "wsit": min(h.num_blobs, 1 << 20)}[table]
    index = rng.randrange(max(count, 1))
    size = craft.field_range(table, name)[1] if name != "shape" else 8
    current = None
    values = craft.boundary_values(len(buf), size)
    if rng.random() < 0.3:              # off by a little from a real value: reaches deeper branches
        off = craft.field_range(table, name)[0] + craft.field_base(buf, table, index)
        if off + size <= len(buf):
            current = int.from_bytes(buf[off:off + min(size, 8)], "little")
            values = [current + d for d in (-4096, -256, -64, -1, 1, 16, 64, 256, 4096)]
    return craft.set_field_value(buf, table, index, name, rng.choice(values), fix=rng.random() < 0.8)


def m_truncate(rng, buf, seeds):
    if rng.random() < 0.7:
        return buf[:rng.randrange(len(buf) + 1)]
    return buf + bytes(rng.choice((1, 7, 64, 4096))) if rng.random() < 0.5 else buf + rng.randbytes(rng.randint(1, 99))


def m_splice(rng, buf, seeds):
    other = rng.choice(seeds) if rng.random() < 0.5 else bytes(buf)
    if not buf or not other:
        return buf
    n = rng.choice((1, 8, 32, 192, 512, 4096))
    src, dst = rng.randrange(len(other)), rng.randrange(len(buf))
    chunk = other[src:src + n]
    buf[dst:dst + len(chunk)] = chunk        # may run past the end: the file then grows
    return buf


def m_insert_delete(rng, buf, seeds):
    if not buf:
        return buf
    pos = rng.randrange(len(buf))
    n = rng.choice((1, 8, 64, 4096))
    if rng.random() < 0.5:
        del buf[pos:pos + n]
    else:
        buf[pos:pos] = bytes(n) if rng.random() < 0.5 else rng.randbytes(n)
    return buf


def _random_leaf_path(rng, obj, depth=0):
    path = []
    node = obj
    while isinstance(node, (dict, list)) and node and depth < 20:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
        depth += 1
        if rng.random() < 0.25:
            break
    return path


def m_metadata(rng, buf, seeds):
    """Change one metadata value (type confusion, boundary numbers, deletion, deep nesting) and re-seal."""
    h = _header(buf)
    if h is None or h.metadata_offset + h.metadata_size > len(buf) or h.metadata_size > 1 << 20:
        return buf
    try:
        meta = json.loads(craft.metadata_bytes(buf))
    except (ValueError, RecursionError):    # an earlier mutation already broke it
        return buf
    if not isinstance(meta, dict):
        return buf
    path = _random_leaf_path(rng, meta)
    if not path:
        return buf
    parent = meta
    for key in path[:-1]:
        parent = parent[key]
    r = rng.random()
    deep = 0
    if r < 0.15 and isinstance(parent, dict):
        del parent[path[-1]]
    elif r < 0.2:
        deep = rng.choice((13, 14, 15, 16, 40, 5000))     # lists inside the leaf's own depth
        parent[path[-1]] = "__DEEP__"
    else:
        parent[path[-1]] = rng.choice(JSON_VALUES)
    try:
        raw = json.dumps(meta, sort_keys=rng.random() < 0.8, separators=(",", ":")).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        return buf
    if deep:            # written as text: json.dumps itself would recurse on 5000 levels
        raw = raw.replace(b'"__DEEP__"', b"[" * deep + b"]" * deep, 1)
    if rng.random() < 0.1:      # raw text edits JSON cannot express: duplicate keys, NaN, bad UTF-8, huge ints
        raw = rng.choice((b'{"format":"colibri",' + raw[1:], raw.replace(b":1.0", b":NaN", 1),
                          raw.replace(b'"', b'"\xc0', 1), raw.replace(b":1.0", b":1e999", 1),
                          raw.replace(b":1.0", b":" + b"7" * 5000, 1), raw[:-1]))
    try:
        return craft.rewrite_metadata(buf, raw)
    except Exception:   # the seed header is already broken: nothing to rewrite
        return buf


MUTATORS = [(m_bitflip, 5), (m_byteset, 3), (m_field, 8), (m_truncate, 1), (m_splice, 2), (m_insert_delete, 1),
            (m_metadata, 4)]


def reseal(rng, buf) -> bytearray:
    """Recompute what covers the mutation so the deeper checks run."""
    h = _header(buf)
    if h is None:
        return buf
    if rng.random() < 0.3:
        try:
            for k in range(min(h.num_dense_tensors, 64)):
                craft.fix_dense_checksum(buf, k)
            for k in range(min(h.num_blobs, 64)):
                craft.fix_expert_checksum(buf, k)
        except Exception:
            pass       # entries already garbled: the re-seal is best effort
    try:
        craft.fix_section_checksums(buf)
    except Exception:
        pass
    return buf


def mutate(rng: random.Random, seeds: list[bytes]) -> bytearray:
    buf = bytearray(rng.choice(seeds))
    funcs, weights = zip(*MUTATORS)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        buf = bytearray(rng.choices(funcs, weights)[0](rng, buf, seeds))
    if rng.random() < 0.6:
        buf = reseal(rng, buf)
    return buf


# --- one execution ---------------------------------------------------------------------------------------------
def run_one(path: str, rng: random.Random) -> tuple[str, str]:
    """(table outcome, validate outcome); raises anything that is not a ColibriFormatError."""
    try:
        load_tables(path)
        tables = "ok"
    except E.ColibriFormatError as exc:
        tables = type(exc).__name__
    for verify in ("first-use", "never"):
        try:
            # dequantizing unverified garbage (verify="never") may overflow to inf: expected, not a finding
            with colibri_format.open(path, verify=verify) as f, np.errstate(all="ignore"):
                names = f.dense_names()
                try:
                    f.dense_f32(rng.choice(names))
                except E.CorruptTensor:
                    pass
                layer = rng.choice(f.tables.plan.moe_layers)
                try:
                    f.expert_f32(layer, rng.randrange(f.header.num_experts))
                except E.CorruptExpert:
                    pass
        except E.ColibriFormatError:
            pass
    try:
        inspect_file(path)
    except E.ColibriFormatError:
        pass
    report = validate_file(path)
    if report.valid:
        return tables, "valid"
    if not report.faults:
        raise AssertionError("invalid report without a fault")
    if (tables == "ok") != (report.faults[0].error in ("CorruptTensor", "CorruptExpert", "NonZeroPadding")):
        raise AssertionError(f"load_tables said {tables} but validate's first fault is {report.faults[0]}")
    return tables, report.faults[0].error


def _alarm(signum, frame):
    raise Hang("input took too long")


def save_crash(data: bytes, exc: BaseException, crash_dir: Path) -> Path:
    crash_dir.mkdir(parents=True, exist_ok=True)
    path = crash_dir / f"crash-{hashlib.sha256(data).hexdigest()[:16]}.colibri"
    path.write_bytes(data)
    path.with_suffix(".txt").write_text("".join(traceback.format_exception(exc)))
    return path


def fuzz(iterations: int, seed: int, timeout: float, crash_dir: Path, quiet: bool) -> dict:
    rng = random.Random(seed)
    seeds = make_seeds()
    scratch = tempfile.mkdtemp(prefix="colibri-fuzz-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    path = os.path.join(scratch, "input.colibri")
    tables_counts, validate_counts, crashes = Counter(), Counter(), []
    signal.signal(signal.SIGALRM, _alarm)
    start = time.perf_counter()
    try:
        for i in range(iterations):
            data = bytes(mutate(rng, seeds))
            with open(path, "wb") as fh:
                fh.write(data)
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                t, v = run_one(path, rng)
                tables_counts[t] += 1
                validate_counts[v] += 1
            except Exception as exc:  # noqa: BLE001 (any non-ColibriFormatError is a finding)
                saved = save_crash(data, exc, crash_dir)
                crashes.append({"input": str(saved), "error": f"{type(exc).__name__}: {exc}"[:300]})
                tables_counts["CRASH"] += 1
                if not quiet:
                    print(f"CRASH at input {i}: {type(exc).__name__}: {exc} -> {saved}", file=sys.stderr)
                    traceback.print_exception(exc, file=sys.stderr)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if not quiet and (i + 1) % 10000 == 0:
                rate = (i + 1) / (time.perf_counter() - start)
                print(f"  {i + 1} inputs, {rate:.0f}/s, crashes {len(crashes)}", file=sys.stderr)
    finally:
        for name in os.listdir(scratch):
            os.unlink(os.path.join(scratch, name))
        os.rmdir(scratch)
    seconds = time.perf_counter() - start
    return {"iterations": iterations, "seed": seed, "seconds": round(seconds, 1),
            "inputs_per_second": round(iterations / seconds, 1) if seconds else None,
            "memory_limit_bytes": MEMORY_LIMIT,
            "tables_outcomes": dict(tables_counts.most_common()),
            "validate_outcomes": dict(validate_counts.most_common()), "crashes": crashes}


def replay(paths: list[str]) -> int:
    bad = 0
    rng = random.Random(0)
    for p in paths:
        try:
            print(p, run_one(p, rng))
        except Exception as exc:  # noqa: BLE001
            bad += 1
            print(f"{p}: CRASH {type(exc).__name__}: {exc}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per input before it counts as a hang")
    parser.add_argument("--crash-dir", type=Path, default=CRASH_DIR)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--replay", nargs="+", metavar="FILE", help="run saved inputs instead of fuzzing")
    args = parser.parse_args(argv)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    if args.replay:
        return replay(args.replay)
    result = fuzz(args.iterations, args.seed, args.timeout, args.crash_dir, quiet=args.json)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['iterations']} inputs in {result['seconds']} s ({result['inputs_per_second']}/s), "
              f"seed {result['seed']}, {len(result['crashes'])} crashes")
        print("load_tables outcome:", result["tables_outcomes"])
        print("validate outcome:   ", result["validate_outcomes"])
    return 1 if result["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())

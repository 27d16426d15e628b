"""Re-reading the `.part` file: which journal records still hold (resume), and a whole-file check.

Resume trusts nothing by size: a journal record counts only if the bytes at its planned slot still hash to
the checksum it recorded. Before the rename every piece is re-hashed once more against the checksums the
directory will carry, which catches a planning or offset bug that per-piece checks cannot see.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from colibri_format.errors import WriteError
from colibri_format.spec.checksum import dense_seed, expert_seed
from colibri_format.writer import ColibriWriter

VERIFY_CHUNK = 8 << 20


def record_slot(writer: ColibriWriter, record: dict[str, Any]) -> tuple[Any, int, int, int] | None:
    """(key, offset, size, seed) of a journal record, or None when the record names nothing in the plan."""
    plan = writer.plan
    if record.get("kind") == "dense":
        t = next((t for t in plan.dense if t.name == record.get("name")), None)
        return None if t is None else (t.name, t.offset, t.size, dense_seed(t.name, t.offset))
    layer, expert = record.get("layer"), record.get("expert")
    if type(layer) is not int or type(expert) is not int or layer not in plan.moe_layers \
            or not 0 <= expert < plan.num_experts:
        return None
    offset = plan.blob_offset(layer, expert)
    return (layer, expert), offset, plan.blob.size, expert_seed(layer, expert, offset)


_local = threading.local()


def _thread_buffer() -> memoryview:
    """One read buffer per thread, allocated once (fresh pages are costly on some VMs)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(VERIFY_CHUNK))
    return buf


def hash_range(fd: int, offset: int, size: int, seed: int) -> int:
    """XXH3-64 of `size` bytes at `offset`, read through one reused buffer (no fresh pages per chunk)."""
    h = xxhash.xxh3_64(seed=seed)
    buf = _thread_buffer()
    done = 0
    while done < size:
        want = min(len(buf), size - done)
        n = os.preadv(fd, [buf[:want]], offset + done)
        if n <= 0:
            break  # short file: the digest will not match
        h.update(buf[:n])
        done += n
    return h.intdigest()


def _record_matches(fd: int, writer: ColibriWriter, record: dict[str, Any]) -> bool:
    slot = record_slot(writer, record)
    checksum = record.get("checksum")
    if slot is None or type(checksum) is not int:
        return False
    _, offset, size, seed = slot
    return hash_range(fd, offset, size, seed) == checksum


def verified_records(fd: int, writer: ColibriWriter, records: list[dict[str, Any]], workers: int
                    ) -> list[dict[str, Any]]:
    """The journal records whose bytes in the .part still hash to the recorded checksum (last one wins)."""
    latest: dict[Any, dict[str, Any]] = {}
    for r in records:
        slot = record_slot(writer, r)
        if slot is not None and _valid_stats(r):
            latest[slot[0]] = r
    with ThreadPoolExecutor(workers) as ex:
        ok = list(ex.map(lambda r: _record_matches(fd, writer, r), latest.values()))
    return [r for r, good in zip(latest.values(), ok) if good]


def _valid_stats(record: dict[str, Any]) -> bool:
    if record.get("kind") == "dense":
        return True
    err = record.get("error")
    return err is None or (isinstance(err, list) and len(err) == 2
                           and all(type(x) in (int, float) and 0 <= x < 1e30 for x in err))


def verify_all(fd: int, writer: ColibriWriter, workers: int) -> None:
    """Re-hash every piece in the .part against its checksum before the rename (catches planning bugs)."""
    plan = writer.plan
    slots = [(t.offset, t.size, dense_seed(t.name, t.offset), writer.dense_checksums[t.name], t.name)
             for t in plan.dense]
    for layer, e in plan.blob_keys():
        off = plan.blob_offset(layer, e)
        slots.append((off, plan.blob.size, expert_seed(layer, e, off), writer.expert_checksums[(layer, e)],
                      f"expert ({layer}, {e})"))
    with ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(lambda s: hash_range(fd, s[0], s[1], s[2]) == s[3], slots))
    bad = [s[4] for s, ok in zip(slots, results) if not ok]
    if bad:
        raise WriteError(f"the .part file does not read back as written ({len(bad)} pieces, first {bad[0]}); "
                         "run again with --restart", field="verify", value=bad[:3])

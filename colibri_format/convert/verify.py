"""Re-reading the `.part` file: which journal records still hold (resume), and a whole-file check.

Resume trusts nothing by size: a journal record counts only if the bytes at its planned slot still hash to
the checksum it recorded, and the source bytes the piece was made from still hash to the source digest it
recorded (an in-place edit of a shard that keeps its size and mtime is caught here: the piece is converted
again). With `verify` (off by default: `convert`'s docstring says why) every piece is re-hashed once more
before the rename against the checksums the directory will carry (`verify_all`).

With direct I/O most pieces are re-hashed early: each run's pieces once the run's writes are done (`flush`
returns only then, helper threads' direct writes included; `ColibriWriter.read_back_later` then reads on a
reader thread, overlapping the rest of the conversion), and `verify_all` re-reads only the pieces not found
intact that way (a read that failed, was cancelled or hashed wrong is no verdict) and those a resume kept.
A piece read back before the job's last write would not see a later stray write into its bytes (a planning
bug: two pieces' slots overlapping, a section written over a blob); an end-of-job pass over every piece
catches the first kind (not the second: the sections are written after it). Both are excluded by
construction instead:

1. Every write of piece bytes goes through a `PieceStream`, which refuses to write past its `Slot`; the
   write buffer only gathers bytes a stream placed there, at the positions the stream asked for, and writes
   out exactly those bytes (whole pages direct, the partial pages at either end buffered: never rounded out
   to a page). The writer makes each piece's `Slot` once; the stream, the read-back and the directory or
   WSIT entry `finalize` writes all take that one object (`ColibriWriter.slot`), so a piece is written,
   checked and recorded at the same bytes.
2. The slots are checked to lie inside the data region and to share no byte when the writer is made
   (before the `.part` exists) and again at the start of `verify_all`; `finalize` checks the entries it is
   about to write, the header, the metadata, the directory and the WSIT the same way (inside the file,
   pairwise disjoint; sorted by offset, one pass: `spec.checks.check_disjoint`, a LayoutError naming the
   field, its value and its position) before it writes the first byte of them.
3. Nothing else writes the `.part` after a piece is written: the direct-I/O probe writes the zero header
   page when the file is opened, before any piece; the journal is another file.

So every write after a piece's own last write lands in a slot or section disjoint from it, and the piece's
bytes are what its read-back hashed: a piece found intact right after its run stays intact until the
rename. (Neither check sees a change from outside the process after the read; the end-of-job pass did not
either, between its read and the rename.)
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from colibri_format.errors import InvalidInput, WriteError
from colibri_format.writer import ColibriWriter, PieceKey


def record_piece(writer: ColibriWriter, record: dict[str, Any]) -> PieceKey | None:
    """The piece a journal record names, or None when it names nothing in the plan (a forged record)."""
    if record.get("kind") == "dense":
        key = record.get("name")
        if not isinstance(key, str):
            return None
    else:
        layer, expert = record.get("layer"), record.get("expert")
        if type(layer) is not int or type(expert) is not int:  # bool is an int subclass: refuse it too
            return None
        key = (layer, expert)
    try:
        writer.slot(key)
    except InvalidInput:
        return None
    return key


def _valid_stats(record: dict[str, Any]) -> bool:
    if record.get("kind") == "dense":
        return True
    err = record.get("error")
    return err is None or (isinstance(err, list) and len(err) == 2
                           and all(type(x) in (int, float) and 0 <= x < 1e30 for x in err))


def keep_journaled_pieces(writer: ColibriWriter, records: list[dict[str, Any]], workers: int,
                          source_digest: Callable[[PieceKey], int], allow_non_finite: bool = False
                          ) -> list[dict[str, Any]]:
    """The journal records whose source still hashes to the recorded `source` digest and whose bytes in the
    .part still hash to the recorded checksum (last record of a piece wins); the writer takes those pieces
    over. A piece recorded as holding non-finite values is kept only while they are allowed."""
    latest: dict[PieceKey, dict[str, Any]] = {}
    for r in records:
        key = record_piece(writer, r)
        if key is not None and _valid_stats(r):
            latest[key] = r  # a later record with a mistyped checksum still replaces an earlier one

    def keep(item: tuple[PieceKey, dict[str, Any]]) -> bool:
        key, record = item
        if type(record.get("checksum")) is not int or type(record.get("source")) is not int:
            return False
        if record.get("non_finite", False) is not False and not allow_non_finite:
            return False
        return source_digest(key) == record["source"] and writer.keep_if_intact(key, record["checksum"])

    with ThreadPoolExecutor(workers) as ex:
        kept = list(ex.map(keep, latest.items()))
    return [r for r, ok in zip(latest.values(), kept) if ok]


def verify_all(writer: ColibriWriter, workers: int) -> None:
    """Re-hash against its checksum, before the rename, every piece not already found intact after its run's writes
    (module docstring: why such a piece cannot have changed since)."""
    writer.check_slots()  # an overlap is a planning bug, not a failed write: refused as such, before any reading
    early = writer.read_back_results()
    keys = [k for k in writer.piece_keys() if k not in early]
    with ThreadPoolExecutor(workers) as ex:
        ok = list(ex.map(lambda k: writer.checksum_on_disk(writer.slot(k)) == writer.checksums[k], keys))
    bad = [k if isinstance(k, str) else f"expert {k}" for k, good in zip(keys, ok) if not good]
    if bad:
        raise WriteError(f"the .part file does not read back as written ({len(bad)} pieces, first {bad[0]}; a "
                         "resume re-checks every piece and converts those again)", field="verify", value=bad[:3])

"""Running pieces on worker threads, and making finished pieces durable in batches.

Workers write at planned offsets, so pieces may finish in any order; at most `2 * workers` are in flight,
which bounds memory. `Batch` keeps the durability order: fsync(.part) first, then the journal records of
the pieces that fsync covered, then fsync(journal).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from colibri_format.convert import crashpoint
from colibri_format.convert.journal import Journal

BATCH_PIECES = 64                 # fsync + journal at least every 64 pieces...
BATCH_BYTES = 256 << 20           # ...or every 256 MB written...
BATCH_SECONDS = 1.0               # ...or every second: bounds the work a crash can lose


class Batch:
    """Pieces written but not yet durable; `flush` = fsync(.part), then journal records, then fsync(journal)."""

    def __init__(self, sync_part: Callable[[], None], journal: Journal) -> None:
        self.sync_part, self.journal = sync_part, journal
        self.records: list[dict[str, Any]] = []
        self.bytes = 0
        self.since = time.monotonic()

    def add(self, record: dict[str, Any], nbytes: int) -> None:
        self.records.append(record)
        self.bytes += nbytes
        if (len(self.records) >= BATCH_PIECES or self.bytes >= BATCH_BYTES
                or time.monotonic() - self.since >= BATCH_SECONDS):
            self.flush()

    def flush(self) -> None:
        if not self.records:
            return
        crashpoint.hit("data-fsync")
        self.sync_part()
        # Taken out before the append: a Ctrl-C landing inside it (say, during the journal's fsync) must not
        # make the error path's flush append the same records a second time.
        records, self.records, self.bytes, self.since = self.records, [], 0, time.monotonic()
        self.journal.append(records)


def run_bounded(items: Iterable[Any], work: Callable[[Any], Any], workers: int,
                 on_done: Callable[[Any], None]) -> None:
    """Run `work` on `workers` threads with at most 2*workers pieces in flight; `on_done` on this thread."""
    queue = iter(items)
    pending: set[Future] = set()
    ex = ThreadPoolExecutor(workers, thread_name_prefix="colibri-convert")
    try:
        while True:
            while len(pending) < 2 * workers and (piece := next(queue, None)) is not None:
                pending.add(ex.submit(work, piece))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                on_done(f.result())
    except BaseException:
        ex.shutdown(wait=True, cancel_futures=True)
        for f in pending:  # finished while we were stopping: keep their work
            if f.done() and not f.cancelled() and f.exception() is None:
                on_done(f.result())
        raise
    ex.shutdown(wait=True)

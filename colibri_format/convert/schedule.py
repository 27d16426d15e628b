"""Running pieces on worker threads, and making finished pieces durable in batches.

Pieces go to the workers in runs (`runs`): consecutive pieces of about RUN_BYTES of source together, so a
worker writes a run of small expert blobs through its write buffer in few large writes, and the hand-offs
between threads stay few whatever the expert size. Workers write at planned offsets, so runs may finish in
any order; at most `2 * workers` are in flight, and memory is the workers' buffers, not the runs. A run that
fails part-way hands on the pieces it finished (`PartialRun`) before its error is raised. `Batch` keeps the
durability order: fsync(.part) first, then the journal records of the pieces that fsync covered, then
fsync(journal).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from colibri_format.convert import crashpoint
from colibri_format.convert.journal import Journal

BATCH_PIECES = 64                 # fsync + journal at least every 64 pieces...
BATCH_BYTES = 256 << 20           # ...or every 256 MB written...
BATCH_SECONDS = 1.0               # ...or every second: bounds the work a crash can lose
RUN_BYTES = 32 << 20              # a run: consecutive pieces of at least this much source...
RUN_PIECES = 64                   # ...or this many pieces (one piece bigger than RUN_BYTES is a run of its own)


def runs(items: Sequence[Any], size: Callable[[Any], int], run_bytes: int = RUN_BYTES,
         run_pieces: int = RUN_PIECES) -> list[list[Any]]:
    """`items` cut, in order, into runs of at least `run_bytes` (by `size`) or `run_pieces` items."""
    out: list[list[Any]] = []
    current: list[Any] = []
    total = 0
    for item in items:
        current.append(item)
        total += size(item)
        if total >= run_bytes or len(current) >= run_pieces:
            out.append(current)
            current, total = [], 0
    if current:
        out.append(current)
    return out


class PartialRun(Exception):
    """A run stopped by `error` after finishing `done` (results whose bytes are written)."""

    def __init__(self, done: list[Any], error: BaseException) -> None:
        super().__init__(str(error))
        self.done, self.error = done, error


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


def _deliver(f: Future, on_done: Callable[[Any], None]) -> None:
    """on_done(result) of a finished future; a PartialRun's finished part first, then its error."""
    try:
        result = f.result()
    except PartialRun as part:
        on_done(part.done)
        raise part.error from None
    on_done(result)


def run_bounded(items: Iterable[Any], work: Callable[[Any], Any], workers: int,
                 on_done: Callable[[Any], None]) -> None:
    """Run `work` on `workers` threads with at most 2*workers items in flight; `on_done` on this thread. An item
    whose work raises PartialRun has its finished part handed to `on_done`, then its error raised."""
    queue = iter(items)
    pending: set[Future] = set()
    ex = ThreadPoolExecutor(workers, thread_name_prefix="colibri-convert")
    try:
        while True:
            while len(pending) < 2 * workers and (item := next(queue, None)) is not None:
                pending.add(ex.submit(work, item))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            errors = []
            for f in finished:  # every finished item is handed on before the first error is raised
                try:
                    _deliver(f, on_done)
                except BaseException as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
    except BaseException:
        ex.shutdown(wait=True, cancel_futures=True)
        for f in pending:  # finished while we were stopping: keep their work
            if f.done() and not f.cancelled():
                try:
                    _deliver(f, on_done)
                except BaseException:  # noqa: S110 - the first error is the one raised
                    pass
        raise
    ex.shutdown(wait=True)

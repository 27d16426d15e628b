"""Full verification of a `.colibri` file: structure, then every checksum and every must-be-zero byte.

Every byte of a valid file is covered by exactly one check: the header checksum, a section checksum,
a dense tensor or expert blob checksum, or a zero rule for padding. So any single-bit flip is caught.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import errors as E
from ..reader import Tables, open_regular, read_tables
from ..spec import checks

Progress = Callable[[int, int], None]   # (bytes done, bytes total)


@dataclass(frozen=True)
class Fault:
    error: str          # ColibriFormatError subclass name
    message: str
    field: str | None = None
    offset: int | None = None

    @classmethod
    def of(cls, exc: E.ColibriFormatError) -> Fault:
        return cls(type(exc).__name__, str(exc), exc.field, exc.offset)


@dataclass
class ValidationReport:
    path: str
    valid: bool = True
    readable: bool = True
    quick: bool = False
    faults: list[Fault] = field(default_factory=list)
    bytes_checked: int = 0
    seconds: float = 0.0

    def add(self, exc: E.ColibriFormatError) -> None:
        self.valid = False
        self.faults.append(Fault.of(exc))

    def to_dict(self) -> dict:
        gbps = self.bytes_checked / self.seconds / 1e9 if self.seconds > 0 else None
        return {"path": self.path, "valid": self.valid, "quick": self.quick, "bytes_checked": self.bytes_checked,
                "seconds": round(self.seconds, 6), "gb_per_s": gbps,
                "faults": [f.__dict__ for f in self.faults]}


def validate_file(path: str | os.PathLike, *, quick: bool = False, progress: Progress | None = None,
                  max_faults: int = 100) -> ValidationReport:
    """Check a file; faults are collected (up to `max_faults`), never raised."""
    report = ValidationReport(str(path), quick=quick)
    start = time.perf_counter()
    try:
        fd, size = open_regular(path)
    except E.NotARegularFile as exc:
        report.readable = False
        report.add(exc)
        return report
    try:
        tables = read_tables(fd, size)
        if not quick:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
                _check_data(memoryview(mm), tables, report, progress, max_faults)
    except E.ColibriFormatError as exc:
        report.add(exc)
    except OSError as exc:
        report.readable = False
        report.add(E.NotARegularFile(f"cannot read: {exc.strerror}", field="path", value=str(path)))
    finally:
        os.close(fd)
        report.seconds = time.perf_counter() - start
    return report


def _check_data(view: memoryview, t: Tables, report: ValidationReport, progress: Progress | None,
                max_faults: int) -> None:
    total = t.plan.metadata_offset
    done = 0

    def fault(exc):
        if len(report.faults) < max_faults:
            report.add(exc)
        else:
            report.valid = False

    for start, end in t.plan.zero_ranges(t.header.metadata_size):
        _check_zero(view, start, end, "padding", fault)
    for e in t.dense:
        bad = checks.dense_fault(view, e)
        if bad is not None:
            fault(bad)
        done += e.size
    if progress:
        progress(done, total)
    pads = t.plan.blob.padding_ranges()
    for row in t.wsit:
        layer, expert, offset, size = int(row["layer"]), int(row["expert"]), int(row["offset"]), int(row["size"])
        bad = checks.expert_fault(view, layer, expert, offset, size, int(row["checksum"]))
        if bad is not None:
            fault(bad)
        for a, b in pads:
            _check_zero(view, offset + a, offset + b, f"expert[{layer},{expert}] padding", fault)
        done += size
        if progress:
            progress(done, total)
    report.bytes_checked = t.file_size


def _check_zero(view: memoryview, start: int, end: int, what: str, fault) -> None:
    chunk = np.frombuffer(view[start:end], dtype=np.uint8)
    if chunk.any():
        first = start + int(np.flatnonzero(chunk)[0])
        fault(E.NonZeroPadding(f"{what} byte must be zero", field=what, value=int(view[first]), offset=first))

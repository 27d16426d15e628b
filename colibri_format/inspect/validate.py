"""Full verification of a `.colibri` file: structure, then every checksum and every must-be-zero byte.

Every byte of a valid file is covered by exactly one check: the header checksum, a section checksum,
a dense tensor or expert blob checksum, or a zero rule for padding. So any single-bit flip is caught.

The data are read with `preadv` into one small reused buffer, never through a memory map: a file that shrinks
while it is checked (truncated by another process) ends the check with one TruncatedFile naming the offset,
where a mapping would kill the process with SIGBUS. The buffer stays in the CPU cache, so hashing from it is
as fast as hashing a mapping (benchmarks/inspect_validate.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .. import errors as E
from ..reader import Tables, open_regular, read_tables
from ..spec.checksum import StreamingDigest, dense_seed, expert_seed

Progress = Callable[[int, int], None]   # (bytes done, bytes total)
READ_CHUNK = 1 << 20                    # bytes per read: hashed while still in the CPU cache


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
    """Check a file; the faults found in it are collected (up to `max_faults`), not raised.

    Raises:
        NotARegularFile: the path cannot be read (no such file, a directory, FIFO, device or kernel pseudo-file,
            or a read fails): there is no verdict to give.
        TruncatedFile, SizeMismatch: the file changed size while it was checked (truncated by another process,
            say): a verdict would be about bytes that are gone.
    """
    report = ValidationReport(str(path), quick=quick)
    start = time.perf_counter()
    fd, size = open_regular(path)
    try:
        try:
            tables = read_tables(fd, size)
        except E.NotARegularFile:
            raise
        except E.ColibriFormatError as exc:
            _same_size(fd, size)                # a short read of a table because the file shrank: no verdict
            report.add(exc)
            return report
        if not quick:
            _check_data(_Reader(fd), tables, report, progress, max_faults)
        _same_size(fd, size)
    finally:
        os.close(fd)
        report.seconds = time.perf_counter() - start
    return report


class _Reader:
    """The file's bytes through one reused buffer; a read that fails or finds the file shorter raises."""

    def __init__(self, fd: int, chunk: int = READ_CHUNK) -> None:
        self.fd = fd
        self.buffer = memoryview(bytearray(chunk))

    def chunks(self, start: int, end: int, what: str) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) pieces that cover [start, end) in order; each is valid until the next is read."""
        pos = start
        while pos < end:
            view = self.buffer[:min(len(self.buffer), end - pos)]
            try:
                got = os.preadv(self.fd, [view], pos)
            except OSError as exc:
                raise E.NotARegularFile(f"cannot read the {what}: {exc.strerror}", field=what, offset=pos) from None
            if got == 0:
                raise E.TruncatedFile(f"the file shrank while it was validated: it now ends inside the {what}",
                                      field=what, offset=pos)
            yield pos, view[:got]
            pos += got


def _same_size(fd: int, size: int) -> None:
    now = os.fstat(fd).st_size
    if now < size:
        raise E.TruncatedFile("the file shrank while it was validated", field="file_size", value=now, offset=now)
    if now > size:
        raise E.SizeMismatch("the file grew while it was validated", field="file_size", value=now, offset=size)


def _check_data(reader: _Reader, t: Tables, report: ValidationReport, progress: Progress | None,
                max_faults: int) -> None:
    total = t.plan.metadata_offset
    done = 0

    def fault(exc: E.ColibriFormatError) -> None:
        if len(report.faults) < max_faults:
            report.add(exc)
        else:
            report.valid = False

    for start, end in t.plan.zero_ranges(t.header.metadata_size):
        for bad in _scan(reader, start, end, "padding", None, [(start, end, "padding")])[1]:
            fault(bad)
    for e in t.dense:
        digest, _ = _scan(reader, e.offset, e.offset + e.size, e.name, dense_seed(e.name, e.offset), [])
        if digest != e.checksum:
            fault(E.CorruptTensor(f"dense tensor {e.name!r} fails its checksum", field=e.name, offset=e.offset))
        done += e.size
    if progress:
        progress(done, total)
    pads = t.plan.blob.padding_ranges()
    for row in t.wsit:
        layer, expert, offset, size = int(row["layer"]), int(row["expert"]), int(row["offset"]), int(row["size"])
        what = f"expert[{layer},{expert}]"
        zeros = [(offset + a, offset + b, f"{what} padding") for a, b in pads]
        digest, padding = _scan(reader, offset, offset + size, what, expert_seed(layer, expert, offset), zeros)
        if digest != int(row["checksum"]):
            fault(E.CorruptExpert(f"expert {expert} of layer {layer} fails its checksum", field=what, offset=offset))
        for bad in padding:
            fault(bad)
        done += size
        if progress:
            progress(done, total)
    report.bytes_checked = t.file_size


def _scan(reader: _Reader, start: int, end: int, what: str, seed: int | None,
          zeros: list[tuple[int, int, str]]) -> tuple[int | None, list[E.NonZeroPadding]]:
    """Read [start, end) once: its XXH3-64 digest with `seed` (None: no digest), and a NonZeroPadding fault for
    the first non-zero byte of each absolute range in `zeros`."""
    digest = StreamingDigest(seed) if seed is not None else None
    pending, faults = list(zeros), []
    for pos, chunk in reader.chunks(start, end, what):
        if digest is not None:
            digest.update(chunk)
        for i, (a, b, label) in enumerate(pending):
            lo, hi = max(a, pos), min(b, pos + len(chunk))
            if lo >= hi:
                continue
            block = np.frombuffer(chunk[lo - pos:hi - pos], dtype=np.uint8)
            if block.any():
                first = lo + int(np.flatnonzero(block)[0])
                faults.append(E.NonZeroPadding(f"{label} byte must be zero", field=label,
                                               value=int(block[first - lo]), offset=first))
                pending[i] = (0, 0, label)             # one fault per range
    return (digest.intdigest() if digest is not None else None), faults

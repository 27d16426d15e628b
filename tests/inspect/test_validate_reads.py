"""`validate` reads with pread, never through a mapping: a file that shrinks (or grows, or fails to read) while
it is checked gives one ColibriFormatError naming the offset, never SIGBUS; and the checks stay the same."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from colibri_format import errors as E
from colibri_format.inspect import inspect_file, validate_file
from colibri_format.inspect import validate as V
from colibri_format.synthetic import synthetic_model, write_synthetic

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> Path:
    """About 6 MB: 48 expert blobs of ~100 KB after the dense tensors, more than a few read chunks."""
    path = tmp_path_factory.mktemp("validate") / "m.colibri"
    write_synthetic(path, synthetic_model(vocab=256, hidden=128, layers=3, experts=16, expert_inter=256),
                    reuse_expert=True)
    return path


@pytest.fixture()
def copy(valid_file, tmp_path) -> Path:
    target = tmp_path / "copy.colibri"
    target.write_bytes(valid_file.read_bytes())
    return target


def test_small_reads_cover_the_file(copy, monkeypatch):
    """With a 4 KiB buffer every piece is split across reads: still valid, every byte checked."""
    monkeypatch.setattr(V._Reader.__init__, "__defaults__", (4096,))
    report = validate_file(copy)
    assert report.valid and report.bytes_checked == copy.stat().st_size


def test_truncated_by_another_thread_mid_check(copy):
    """A real truncation while the data are being checked (after the first expert), from another thread."""
    size, cut = copy.stat().st_size, inspect_file(copy)["experts"]["entries"][10]["offset"] + 100
    seen = []

    def progress(done: int, total: int) -> None:
        if done and not seen:
            seen.append(done)
            worker = threading.Thread(target=os.truncate, args=(copy, cut))
            worker.start()
            worker.join()

    with pytest.raises(E.TruncatedFile) as info:
        validate_file(copy, progress=progress)
    assert seen and copy.stat().st_size == cut < size
    assert info.value.offset == cut and "shrank" in str(info.value) and "expert[" in info.value.field


def test_shrinking_read_injected(copy, monkeypatch):
    """The file loses its tail between two reads of the data pass."""
    real, calls = os.preadv, []
    half = copy.stat().st_size // 2

    def preadv(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 8:
            os.truncate(copy, half)
        return real(fd, buffers, offset)

    monkeypatch.setattr(V.os, "preadv", preadv)
    with pytest.raises(E.TruncatedFile, match="shrank") as info:
        validate_file(copy)
    assert info.value.offset >= half and len(calls) >= 8      # the first read past the new end


def test_shrunk_before_the_tables_are_read(copy, monkeypatch):
    """A truncation between the open (which saw the full size) and the reads of the tables is no verdict either."""
    from colibri_format import reader

    real, calls = reader.os.pread, []

    def pread(fd, size, offset):
        calls.append(offset)
        if len(calls) == 2:                     # after the header: the sections lie at the end of the file
            os.truncate(copy, copy.stat().st_size // 2)
        return real(fd, size, offset)

    monkeypatch.setattr(reader.os, "pread", pread)
    with pytest.raises(E.TruncatedFile, match="shrank"):
        validate_file(copy)


def test_grown_while_checked(copy):
    def progress(done: int, total: int) -> None:
        if done and copy.stat().st_size == size:
            with open(copy, "ab") as f:
                f.write(b"\0" * 10)

    size = copy.stat().st_size
    with pytest.raises(E.SizeMismatch, match="grew"):
        validate_file(copy, progress=progress)


def test_read_error_is_unreadable(copy, monkeypatch):
    import errno

    def preadv(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(V.os, "preadv", preadv)
    with pytest.raises(E.NotARegularFile, match="cannot read") as info:
        validate_file(copy)
    assert info.value.offset is not None


def test_faults_are_still_found_across_reads(copy, monkeypatch):
    """A flipped byte inside an expert and a non-zero padding byte in another, pieces split across small reads."""
    from colibri_format.reader import load_tables

    monkeypatch.setattr(V._Reader.__init__, "__defaults__", (4096,))
    tables = load_tables(copy)
    rows = tables.wsit
    pad_start, pad_end = tables.plan.blob.padding_ranges()[-1]         # the blob's tail, up to 4096-alignment
    flipped, padded = int(rows[5]["offset"]) + 5000, int(rows[9]["offset"]) + pad_end - 1
    for offset, byte in ((flipped, None), (padded, 7)):
        with open(copy, "r+b") as f:
            f.seek(offset)
            old = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([old ^ 1 if byte is None else byte]))
    report = validate_file(copy)
    assert [(f.error, f.offset) for f in report.faults] == [
        ("CorruptExpert", int(rows[5]["offset"])), ("CorruptExpert", int(rows[9]["offset"])),
        ("NonZeroPadding", padded)]

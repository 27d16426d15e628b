"""The `.colibri` reader: checked tables, a lazy memory map and zero-copy NumPy views.

Opening a file reads only the header and the three sections (with `pread`, each size checked first);
tensor and expert bytes are mapped, never read until asked for. Expert blobs are verified against their
seeded checksum on first use by default, so corrupt weights never reach a kernel.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import errors as E
from . import spec as S
from .dequant import dequantize_matrix
from .dtypes import NUMPY_STORAGE, to_float32
from .spec import checks

VERIFY_POLICIES = ("never", "first-use", "always")


@dataclass(frozen=True)
class Tables:
    """Everything `colibri inspect` needs: header and sections, all checked."""

    header: S.Header
    metadata: dict
    dense: tuple[S.DenseEntry, ...]
    wsit: np.ndarray
    plan: S.FilePlan
    file_size: int


@dataclass(frozen=True)
class ExpertView:
    """Zero-copy views of one expert's arrays as stored (scales are None when unquantized; int4_group and mxfp4
    matrices are uint8 [rows, inputs / 2], two values a byte, and mxfp4 scales uint8 E8M0 bytes)."""

    gate_up: np.ndarray
    gate_up_scale: np.ndarray | None
    down: np.ndarray
    down_scale: np.ndarray | None


# Filesystems whose "regular files" are kernel views (/proc/self/mem, /sys/...): sizes that lie, reads that fail.
PSEUDO_FILESYSTEMS = frozenset({"proc", "sysfs", "debugfs", "tracefs", "securityfs", "configfs", "cgroup",
                                "cgroup2", "pstore", "bpf", "efivarfs", "fusectl", "binfmt_misc", "nsfs",
                                "selinuxfs", "hugetlbfs", "rpc_pipefs", "devpts", "mqueue"})


def open_regular(path: str | os.PathLike) -> tuple[int, int]:
    """Open read-only without blocking (a FIFO must not hang us); demand a regular file.

    Raises:
        NotARegularFile: no such file, not openable, a directory, FIFO, socket or device, or a kernel pseudo-file
            (/proc, /sys, ...) that claims to be regular.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise E.NotARegularFile("no such file", field="path", value=str(path)) from None
    except OSError as exc:
        raise E.NotARegularFile(f"cannot open: {exc.strerror}", field="path", value=str(path)) from None
    st = os.fstat(fd)
    problem = None if stat.S_ISREG(st.st_mode) else "not a regular file"
    if problem is None and st.st_blocks == 0:          # no data on disk: empty, sparse, or a kernel view
        problem = _pseudo_file(fd, st)
    if problem is not None:
        os.close(fd)
        raise E.NotARegularFile(problem, field="path", value=str(path))
    return fd, st.st_size


def _pseudo_file(fd: int, st: os.stat_result) -> str | None:
    """Why a regular file with no blocks is a kernel view rather than a file, or None."""
    fstype = _filesystem_type(st.st_dev)
    if fstype in PSEUDO_FILESYSTEMS:
        return f"not a regular file: a {fstype} pseudo-file"
    if st.st_size == 0:                                 # an empty file reads nothing; a kernel view may not
        try:
            data = os.pread(fd, 1, 0)
        except OSError as exc:
            return f"not a regular file: reading it fails ({exc.strerror})"
        if data:
            return "not a regular file: its size is 0 but it has data"
    return None


def _filesystem_type(dev: int) -> str | None:
    """The type of the filesystem mounted as device `dev` (Linux /proc/self/mountinfo), None where unknown."""
    key = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with io.open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(" - ", 1)
                if len(fields) == 2 and line.split(" ", 3)[2:3] == [key]:
                    return fields[1].split(" ", 1)[0]
    except OSError:
        pass
    return None


def pread_exact(fd: int, size: int, offset: int, what: str) -> bytes:
    """`size` bytes at `offset`; a short read is TruncatedFile, a failing one NotARegularFile (unreadable)."""
    try:
        data = os.pread(fd, size, offset)
    except OSError as exc:
        raise E.NotARegularFile(f"cannot read the {what}: {exc.strerror}", field=what, offset=offset) from None
    if len(data) != size:
        raise E.TruncatedFile(f"file ended inside the {what}", field=what, value=len(data), offset=offset)
    return data


def read_tables(fd: int, file_size: int) -> Tables:
    """Read and check the header, metadata, dense directory and WSIT; nothing else is touched."""
    head = pread_exact(fd, min(S.HEADER_SIZE, file_size), 0, "header")
    h = checks.parse_header(head, file_size)
    meta_raw = pread_exact(fd, h.metadata_size, h.metadata_offset, "metadata")
    checks.check_section(h, S.Section.METADATA, meta_raw)
    dir_raw = pread_exact(fd, h.dense_dir_size, h.dense_dir_offset, "dense_dir")
    checks.check_section(h, S.Section.DENSE_DIRECTORY, dir_raw)
    wsit_raw = pread_exact(fd, h.wsit_size, h.wsit_offset, "wsit")
    checks.check_section(h, S.Section.WSIT, wsit_raw)
    meta = S.decode_metadata(meta_raw, h.metadata_offset)
    _check_metadata(meta, h)
    entries = checks.parse_dense_directory(h, dir_raw)
    wsit = checks.parse_wsit(h, wsit_raw)
    plan = checks.check_layout(h, entries, wsit)
    checks.check_metadata_agrees(h, meta, entries, plan)
    return Tables(h, meta, tuple(entries), wsit, plan, file_size)


def _check_metadata(meta: dict, h: S.Header) -> None:
    try:
        S.check_metadata(meta)
    except E.InvalidMetadata as exc:
        raise E.InvalidMetadata(str(exc), field=exc.field, value=exc.value, offset=h.metadata_offset) from None


def load_tables(path: str | os.PathLike) -> Tables:
    fd, size = open_regular(path)
    try:
        return read_tables(fd, size)
    finally:
        os.close(fd)


class ColibriFile:
    """An open `.colibri` file. Use `colibri_format.open(path)` as a context manager."""

    def __init__(self, path: str | os.PathLike, verify: str = "first-use") -> None:
        if verify not in VERIFY_POLICIES:
            raise E.InvalidInput(f"verify must be one of {VERIFY_POLICIES}", field="verify", value=verify)
        self.path = Path(path)
        self.verify = verify
        fd, size = open_regular(path)
        try:
            self.tables = read_tables(fd, size)
            try:
                self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:
                raise E.NotARegularFile(f"cannot map the file: {exc}", field="path", value=str(path)) from None
        finally:
            os.close(fd)
        self._dense = {e.name: e for e in self.tables.dense}
        self._verified: set = set()

    # --- tables -----------------------------------------------------------------------------------
    @property
    def header(self) -> S.Header:
        return self.tables.header

    @property
    def metadata(self) -> dict:
        return self.tables.metadata

    @property
    def model(self) -> dict:
        return self.tables.metadata["model"]

    @property
    def wsit(self) -> np.ndarray:
        return self.tables.wsit

    @property
    def blob_layout(self) -> S.BlobLayout:
        return self.tables.plan.blob

    def dense_names(self) -> list[str]:
        return [e.name for e in self.tables.dense]

    def _map(self) -> mmap.mmap:
        """The mapping, or InvalidInput once the file is closed (never a TypeError from a None map)."""
        if self._mm is None:
            raise E.InvalidInput("the file is closed", field="file", value=str(self.path))
        return self._mm

    # --- dense tensors ----------------------------------------------------------------------------
    def _entry(self, name: str) -> S.DenseEntry:
        if not isinstance(name, str):
            raise E.InvalidInput("a dense tensor name is a string", field="name", value=repr(name)[:64])
        entry = self._dense.get(name)
        if entry is None:
            raise E.InvalidInput("no such dense tensor in this file", field="name", value=name)
        return entry

    def dense(self, name: str) -> np.ndarray:
        """Zero-copy read-only view in the stored dtype (bf16 as uint16 bit patterns)."""
        e = self._entry(name)
        self._maybe_verify(("dense", name), lambda: self.verify_dense(name))
        count = e.size // S.DTYPE_SIZE[S.DType(e.dtype)]
        return np.frombuffer(self._map(), NUMPY_STORAGE[S.DType(e.dtype)], count, e.offset).reshape(e.shape)

    def dense_f32(self, name: str) -> np.ndarray:
        return to_float32(self.dense(name))

    def verify_dense(self, name: str) -> None:
        e = self._entry(name)
        fault = checks.dense_fault(memoryview(self._map()), e)
        if fault is not None:
            raise fault
        self._verified.add(("dense", name))

    # --- experts ----------------------------------------------------------------------------------
    def _blob_entry(self, layer: int, expert: int) -> tuple[int, int, int]:
        plan = self.tables.plan
        for field, value in (("layer", layer), ("expert", expert)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):   # True is not layer 1
                raise E.InvalidInput(f"{field} must be an integer", field=field, value=repr(value)[:64])
        layer, expert = int(layer), int(expert)
        if layer not in plan.moe_layers or not 0 <= expert < plan.num_experts:
            raise E.InvalidInput("no such (layer, expert) in this file", field="expert", value=(layer, expert))
        row = self.tables.wsit[plan.blob_index(layer, expert)]
        return int(row["offset"]), int(row["size"]), int(row["checksum"])

    def expert_blob(self, layer: int, expert: int) -> memoryview:
        """The whole blob (one contiguous, 4096-aligned range), e.g. for one DMA to the GPU."""
        offset, size, _ = self._blob_entry(layer, expert)
        self._maybe_verify(("expert", layer, expert), lambda: self.verify_expert(layer, expert))
        return memoryview(self._map())[offset:offset + size]

    def blob_offset(self, layer: int, expert: int) -> int:
        return self._blob_entry(layer, expert)[0]

    def verify_expert(self, layer: int, expert: int) -> None:
        offset, size, checksum = self._blob_entry(layer, expert)
        fault = checks.expert_fault(memoryview(self._map()), layer, expert, offset, size, checksum)
        if fault is not None:
            raise fault
        self._verified.add(("expert", layer, expert))

    def expert(self, layer: int, expert: int) -> ExpertView:
        offset, _, _ = self._blob_entry(layer, expert)
        self._maybe_verify(("expert", layer, expert), lambda: self.verify_expert(layer, expert))
        views = {}
        for a in self.blob_layout.arrays:
            count = a.shape[0] * a.shape[1]
            views[a.name] = np.frombuffer(self._map(), NUMPY_STORAGE[a.dtype], count,
                                          offset + a.offset).reshape(a.shape)
        return ExpertView(views["gate_up"], views.get("gate_up_scale"), views["down"], views.get("down_scale"))

    def expert_f32(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized (gate_up [2I,H], down [H,I]) as new float32 arrays."""
        v = self.expert(layer, expert)
        fmt = S.ExpertFormat(self.header.expert_format)
        if fmt not in S.QUANTIZED_FORMATS:
            return to_float32(v.gate_up), to_float32(v.down)
        return (dequantize_matrix(fmt, v.gate_up, v.gate_up_scale, np.float32),
                dequantize_matrix(fmt, v.down, v.down_scale, np.float32))

    def _maybe_verify(self, key, check) -> None:
        if self.verify == "always" or (self.verify == "first-use" and key not in self._verified):
            check()

    # --- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # NumPy views still point into the map; it is unmapped when they are collected

    def __enter__(self) -> ColibriFile:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 q[r, c] * scale[r, c // g], where g = columns / scale columns (the other formats: `dequant.py`)."""
    rows, cols = q.shape
    groups = scale.shape[1]
    out = q.astype(np.float32).reshape(rows, groups, cols // groups)
    out *= scale[:, :, None]
    return out.reshape(rows, cols)


def open(path: str | os.PathLike, verify: str = "first-use") -> ColibriFile:  # noqa: A001 (mirrors builtins.open)
    """Open a `.colibri` file: checks all tables, maps the data lazily.

    Raises:
        ColibriFormatError: any fault in the file (a subclass names field, value and offset).
    """
    return ColibriFile(path, verify)

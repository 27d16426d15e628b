"""The `.colibri` writer: planned, positional, crash-safe, and the only code that writes a `.colibri` file.

Every offset is planned from the model's shapes before the first byte is written, so the file's pieces
(dense tensors and expert blobs) can be written in any order (by several threads, or after a resume)
with positional writes into a `.part` file beside the destination. Each piece goes through a
`PieceStream`, which hashes the bytes as it writes them: the writer knows every checksum its tables will
carry without reading anything back. On resume, a piece written by an earlier run is taken over only once
its bytes re-hash to the checksum the caller's journal recorded (`keep_if_intact`).

A buffered stream (`stream(key, buffered=True)`) puts its bytes in the calling thread's write buffer
instead: bytes for consecutive file positions (the rest of a piece, the next blob) gather there and go out
in one positional write when the buffer is full, when the next bytes are not contiguous, or at `flush()`.
A piece finished in the buffer has its checksum recorded only once its last bytes are written. A caller
may also fill the buffer in place (`reserve` / `commit`), so converted rows are never copied.

Direct I/O: where the filesystem takes it, the `.part` is also opened a second time with O_DIRECT (one probe
at open: a direct write of the zero header page), and a write buffer's whole pages go out through it, from the
page-aligned buffer straight to the device: no page-cache pages are allocated, filled and written back (on the
2-core CI VM that kernel work cost 0.9-1.4 s of CPU per GB written to ext4, direct writes 0.05-0.1). The bytes
of a buffer before its first and after its last page boundary, and every other write (unbuffered streams, the
sections and header of `finalize`), go through the page cache as before; they never share a page with a direct
write, and the kernel keeps the two paths coherent either way (a direct write flushes and drops cached pages of
its range first). The read-back (resume, the final verify pass) then reads through O_DIRECT as well, so it
checks what the device holds instead of filling the page cache; a converter's pieces can be read back as soon as
their writes are done (`read_back_later`), which is sound because each piece's `Slot` is made once, bounds every
write of the piece and is what the tables record, and the slots and sections are checked disjoint
(convert/verify.py). fsync of the `.part` covers both descriptors (one inode), so the durability protocol is
unchanged. Where O_DIRECT is refused (EINVAL: no direct I/O, or an alignment it does not take) everything is
written buffered; so it is on tmpfs and ramfs, which take O_DIRECT but keep the file in the page cache anyway.

`finalize()` writes the metadata, the directory, the WSIT and, last, the header; then fsync, rename over
the destination and fsync the folder. An interrupted job therefore never leaves anything at the
destination, and a reader rejects a `.part` file (its header is zero).
"""

from __future__ import annotations

import mmap
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from . import spec as S
from .dtypes import NUMPY_STORAGE, to_storage
from .errors import InvalidInput, WriteError
from .fsutil import atomic_replace, create_fresh, file_id, fsync_fd, open_private, pwrite_all, unlink_if_ours
from .spec.checks import Region, check_disjoint, group_rule
from .spec.checksum import dense_seed, digest, expert_seed, section_seed
from .spec.structs import DENSE_ENTRY_FIELD_OFFSETS, HEADER_FIELD_OFFSETS, WSIT_ENTRY_FIELD_OFFSETS

PieceKey = str | tuple[int, int]  # a dense tensor's name, or (layer, expert) of an expert blob
# Read-back (the final verify pass, resume) in pieces that stay in a core's cache between the read and the hash: on
# the 2-core CI VM (1 MiB of L2 a core), re-hashing 2.4 GB of a just-written tmpfs file cost 0.13 s of CPU a GB in
# 512 KiB reads against 0.16 in 8 MiB reads (median of 4 runs each; 0.14 with 1-2 MiB).
READ_BACK_CHUNK = 512 << 10
WRITE_BUFFER_BYTES = 4 << 20  # one per writing thread, for buffered streams (small: its bytes are still in cache)
# A buffer goes out in writes of at most this size. Linux sizes page-cache folios by the write's length (ext4
# has large folios): a multi-MB write asks for 2 MiB blocks of memory, which on a VM that hands free memory back
# to its host are the ones that come back cold. On the 2-core CI VM, writing 2.4 GB to ext4 cost 1.4-2.1 s of
# kernel time per GB in 4 and 16 MB writes, 0.3-1.2 s in 256 KB to 1 MB writes (tmpfs: ~0.35 s whatever the
# size); a whole conversion to ext4 ran at 0.5 GB/s with 16 MB writes, 1.3-1.6 GB/s with 1 MB writes.
WRITE_CALL_BYTES = 1 << 20
# Direct I/O (module docstring): offsets, lengths and buffer addresses in multiples of this (the page size; also
# the blob alignment, so expert blobs are always whole direct writes).
DIRECT_ALIGN = 4096
DIRECT_READ_CHUNK = 4 << 20  # direct reads go to the device: large requests (the data does not stay in cache anyway)
_ZEROS = bytes(S.BLOB_ALIGNMENT)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of `nbytes` (anonymous memory: mmap is page-aligned)."""
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


# Filesystems whose files live in memory: O_DIRECT is accepted there (tmpfs since Linux 6.6) but goes through the
# page cache all the same, so the direct path would only add its threads (qwen3w to /dev/shm: 4.5-7.4 s against
# 3.3-3.8 buffered on the 2-core VM).
_MEMORY_FS = (0x01021994, 0x858458F6)  # TMPFS_MAGIC, RAMFS_MAGIC


def _filesystem_type(fd: int) -> int | None:
    """f_type of fstatfs(fd) (Linux), None where it cannot be had."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux); f_type comes first
        if libc.fstatfs(fd, buf) != 0:
            return None
        return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    except (OSError, AttributeError, ValueError):
        return None


_FALLOC_FL_KEEP_SIZE = 1  # linux/falloc.h: allocate blocks, never change the file's size


def _allocate_blocks(fd: int, length: int) -> bool:
    """fallocate(2) the file's first `length` bytes (Linux; holes become allocated unwritten extents that read as
    zeros, data already there is untouched); False where it cannot be done."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(length)) == 0
    except (OSError, AttributeError, ValueError):
        return False


def _address(data) -> int:
    return np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0


def part_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.part")


@dataclass(frozen=True)
class Slot:
    """Where one piece lives: `size` bytes at `offset`, checksummed with the spec's `seed`."""

    key: PieceKey
    offset: int
    size: int
    seed: int


class _WriteBuffer:
    """One thread's write buffer: bytes for the file positions [start, start + length), and the pieces
    finished in it (their checksums are recorded once those bytes are written). With `blocks` 2 (direct I/O)
    it fills one block of memory while the other one's write is under way (`pending`)."""

    def __init__(self, capacity: int, blocks: int = 1) -> None:
        # Kept for the thread's whole run (fresh pages are costly); page-aligned, one page larger than `capacity`:
        # `data` starts at the file offset's position within a page, so that every page boundary of the file
        # falls on a page boundary of memory (what O_DIRECT needs).
        self._blocks = [_aligned_buffer(capacity + DIRECT_ALIGN) for _ in range(blocks)]
        self.pending: list[Future | None] = [None] * blocks
        self.current = 0
        self._memory = self._blocks[0]
        self.capacity = capacity
        self.data = self._memory[:capacity]
        self.start = 0
        self.length = 0
        self.finished: list[tuple[PieceKey, int]] = []

    def switch(self) -> Future | None:
        """Go on in the next block (the caller took this one's bytes); returns that block's write in flight."""
        self.current = (self.current + 1) % len(self._blocks)
        self._memory = self._blocks[self.current]
        self.data = self._memory[:self.capacity]
        pending, self.pending[self.current] = self.pending[self.current], None
        return pending

    def carry_in(self, start: int, tail: np.ndarray, finished: list[tuple[PieceKey, int]]) -> None:
        """Start the (just switched to) block with `tail`, the bytes for the file positions from `start` (a page
        boundary) that the previous block held past its last whole page, and the pieces finished in them."""
        self.start = start
        self.data = self._memory[:self.capacity]
        self.data[:len(tail)] = tail
        self.length = len(tail)
        self.finished = finished

    def room(self, offset: int, n: int) -> np.ndarray | None:
        """A view to fill with the n bytes at file `offset` (None: flush first, or too big for the buffer)."""
        if n > self.capacity or (self.length and (offset != self.start + self.length
                                                  or self.length + n > self.capacity)):
            return None
        if not self.length:
            self.start = offset
            skew = offset % DIRECT_ALIGN
            self.data = self._memory[skew:skew + self.capacity]
        return self.data[self.length:self.length + n]


class PieceStream:
    """Forward-only writes of one piece from the start of its slot, hashed on the way.

    The checksum therefore equals the one-shot XXH3 of the finished piece, without the piece ever being
    in memory. Streams of different pieces may be used from different threads at once. A buffered stream
    goes through the calling thread's write buffer (module docstring); it is used on that thread only.
    """

    def __init__(self, writer: ColibriWriter, slot: Slot, buffer: _WriteBuffer | None = None) -> None:
        self.slot = slot
        self.pos = 0
        self._writer = writer
        self._buffer = buffer
        self._reserved = 0
        self._hash = xxhash.xxh3_64(seed=slot.seed)

    def _check_room(self, n: int) -> None:
        if self.pos + n > self.slot.size:
            raise WriteError("piece overflows its planned slot", field="offset", value=self.slot.offset + self.pos)

    def put(self, data) -> None:
        view = memoryview(data).cast("B")
        self._check_room(len(view))
        if self._buffer is None:
            self._writer._write_at(view, self.slot.offset + self.pos)
        else:
            room = self.reserve(len(view))
            if room is None:  # bigger than the whole buffer: written now, after what the buffer holds
                self._writer.flush()
                self._writer._write_at(view, self.slot.offset + self.pos)
            else:
                room[:] = np.frombuffer(view, np.uint8)
                self._buffer.length += len(view)
            self._reserved = 0
        self._hash.update(view)
        self.pos += len(view)

    def reserve(self, n: int) -> np.ndarray | None:
        """Buffered streams: a uint8 view of the piece's next n bytes in the write buffer, to fill in place and
        then `commit`; None when unbuffered or larger than the buffer."""
        self._check_room(n)
        if self._buffer is None:
            return None
        room = self._buffer.room(self.slot.offset + self.pos, n)
        if room is None and n <= len(self._buffer.data):
            self._writer.flush(wait=False, upcoming=(self.slot.offset + self.pos, n))
            room = self._buffer.room(self.slot.offset + self.pos, n)
        self._reserved = n if room is not None else 0
        return room

    def commit(self, n: int) -> None:
        """Take the n bytes filled in after `reserve(n)` (or fewer) as the piece's next bytes."""
        buf = self._buffer
        if buf is None or not 0 <= n <= self._reserved:
            raise WriteError("commit without a matching reserve", field="offset", value=self.slot.offset + self.pos)
        self._reserved = 0
        self._hash.update(buf.data[buf.length:buf.length + n])
        buf.length += n
        self.pos += n

    def pad_to(self, pos: int) -> None:
        """Zeros up to `pos`, written rather than assumed: a resumed run may be overwriting older bytes."""
        if self._buffer is not None and pos > self.pos:
            room = self.reserve(pos - self.pos)
            if room is not None:
                room[:] = 0
                self.commit(pos - self.pos)
        while self.pos < pos:
            self.put(_ZEROS[:min(len(_ZEROS), pos - self.pos)])

    def finish(self) -> int:
        """Zero-fill the rest of the slot, record the piece's checksum with the writer (for a buffered stream,
        once the buffer's bytes are written), and return it."""
        self.pad_to(self.slot.size)
        checksum = self._hash.intdigest()
        if self._buffer is not None and self._buffer.length:
            self._buffer.finished.append((self.slot.key, checksum))
        else:
            self._writer.checksums[self.slot.key] = checksum
        return checksum


class ColibriWriter:
    """Write one `.colibri` file for `model` (the metadata `model` object).

    Args:
        path: destination file.
        model: normalized model description (docs/design.md); decides the dense tensors and blob shape.
        dense_dtype: storage dtype of every dense tensor.
        expert_format: storage of expert matrices; `group_size` for INT8_GROUP, INT4_GROUP and MXFP4 (32).
        resume: reopen an existing `.part` file instead of starting a new one; pieces already in it count
            only once `keep_if_intact` has re-hashed them.
        before_piece_write: called before every write of piece bytes (the converter's crash-test hook).
    """

    def __init__(self, path: str | os.PathLike, model: dict, *, dense_dtype: S.DType,
                 expert_format: S.ExpertFormat, group_size: int = 0, resume: bool = False,
                 before_piece_write: Callable[[], None] = lambda: None) -> None:
        S.check_model(model)
        self.path = Path(path)
        self.model = model
        self.dense_dtype = S.DType(dense_dtype)
        self.expert_format = S.ExpertFormat(expert_format)
        self.group_size = group_size if self.expert_format in S.GROUPED_FORMATS else 0
        self._check_dims()
        blob = S.blob_layout(model["hidden_size"], model["expert_intermediate_size"], self.expert_format,
                             self.group_size)
        dense = [(name, self.dense_dtype, shape) for name, shape in S.canonical_dense_tensors(model)]
        self.plan = S.plan_file(dense, tuple(model["moe_layers"]), model["num_experts"], blob)
        self._dense_index = {t.name: t for t in self.plan.dense}
        # Every piece's slot, made once: the streams that write a piece are bounded by this very object, and the
        # directory and WSIT entries `finalize` writes are made from it. Checked before anything is created: inside
        # the data region, and no two sharing a byte (a planning bug never writes a byte).
        self._slots: dict[PieceKey, Slot] = {
            **{t.name: Slot(t.name, t.offset, t.size, dense_seed(t.name, t.offset)) for t in self.plan.dense},
            **{(layer, e): Slot((layer, e), self.plan.blob_offset(layer, e), self.plan.blob.size,
                                expert_seed(layer, e, self.plan.blob_offset(layer, e)))
               for layer, e in self.plan.blob_keys()}}
        self.check_slots()
        self.checksums: dict[PieceKey, int] = {}  # every piece written (or kept) so far
        self._before_piece_write = before_piece_write
        self._read_buffers = threading.local()
        self._write_buffers = threading.local()
        # One positional write at a time: the kernel serializes writes to one file anyway (the inode lock),
        # and a thread waiting here sleeps, where one waiting on the inode lock spins on a CPU.
        self._write_lock = threading.Lock()
        self._io: ThreadPoolExecutor | None = None  # direct I/O: writes a full buffer while its thread goes on
        self._read_backs: dict[PieceKey, tuple[int, Future]] = {}  # read_back_later: checksum, re-hash on disk
        self._reader: ThreadPoolExecutor | None = None  # its own thread: reads never queue ahead of writes
        self.part_path = part_path_for(self.path)
        self._fd = self._open_part(resume)
        self._part_id = file_id(self._fd)
        self._dfd = self._open_direct()  # -1: no direct I/O here

    # --- setup ------------------------------------------------------------------------------------
    def _check_dims(self) -> None:
        m = self.model
        for key in ("hidden_size", "expert_intermediate_size"):
            if m[key] % S.DIM_MULTIPLE:
                raise InvalidInput(f"{key} must be a multiple of {S.DIM_MULTIPLE} for .colibri v1",
                                   field=key, value=m[key])
        why = group_rule(self.expert_format, self.group_size, m["hidden_size"], m["expert_intermediate_size"])
        if why is not None:
            raise InvalidInput(f"group size {self.group_size}: {why}", field="group_size", value=self.group_size)

    def _open_part(self, resume: bool) -> int:
        # Never through a link planted at the .part name: a resumed run reuses only a regular file of its
        # own (one name, not a symlink), anything else is replaced by a fresh file (O_EXCL | O_NOFOLLOW).
        fd = open_private(self.part_path) if resume else None
        if fd is None:
            fd = create_fresh(self.part_path)
        try:
            # Sparse zero-filled space up to the sections: padding is zero without being written.
            if os.fstat(fd).st_size != self.plan.metadata_offset:
                os.ftruncate(fd, self.plan.metadata_offset)
        except OSError as exc:
            os.close(fd)
            raise WriteError(f"cannot size {self.part_path}: {exc.strerror}") from None
        return fd

    def _open_direct(self) -> int:
        """The `.part` opened once more with O_DIRECT (through /proc/self/fd: the very file of `_fd`, never a name
        that could have changed), if a direct write of the zero header page works: the header stays zero until
        `finalize` writes it, so the probe changes nothing. -1 where O_DIRECT is refused (EINVAL and the like), and
        on tmpfs and ramfs (module docstring)."""
        if not _O_DIRECT or _filesystem_type(self._fd) in _MEMORY_FS:
            return -1
        try:
            dfd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR | _O_DIRECT | _CLOEXEC)
        except OSError:
            return -1
        try:
            if file_id(dfd) != self._part_id or os.pwrite(dfd, _aligned_buffer(DIRECT_ALIGN), 0) != DIRECT_ALIGN:
                raise OSError("not the .part, or a short write")
        except OSError:
            os.close(dfd)
            return -1
        return dfd

    @property
    def direct_io(self) -> bool:
        """Whether whole pages of buffered streams go out with O_DIRECT (module docstring)."""
        return self._dfd >= 0

    def allocate_data_region(self) -> None:
        """Direct I/O only: allocate the blocks of every piece's slot up front (after `check_free_space`). A direct
        write into a hole allocates blocks, and ext4 then holds the inode lock exclusively until the device has
        the data, so the helper threads' writes and the partial pages' buffered writes all queue behind one
        another; into allocated blocks direct writes take the lock shared and run side by side. Best effort: where
        it fails (no fallocate, a full disk) the writes allocate as before and report what goes wrong."""
        if self._dfd >= 0:
            _allocate_blocks(self._fd, self.plan.metadata_offset)

    def check_free_space(self, extra_metadata_bytes: int = 0) -> None:
        """Raise WriteError before writing when the folder cannot hold what is left to write (the .part is sparse:
        what it already holds counts); `extra_metadata_bytes`: a tokenizer or other large metadata to come."""
        plan = self.plan
        n_blobs = len(plan.moe_layers) * plan.num_experts
        tables = len(plan.dense) * S.DENSE_ENTRY_SIZE + n_blobs * S.WSIT_ENTRY_SIZE
        needed = plan.metadata_offset + extra_metadata_bytes + tables + n_blobs * 128 + (1 << 20)
        try:
            already = os.fstat(self._fd).st_blocks * 512
            free = shutil.disk_usage(self.part_path.parent).free
        except OSError as exc:
            raise WriteError(f"cannot check free space: {exc.strerror}") from None
        if free < needed - already:
            raise WriteError(f"not enough free space in {self.part_path.parent}: the file needs "
                             f"{needed - already:,} more bytes, {free:,} are free", field="free_space",
                             value=needed - already)

    # --- pieces -----------------------------------------------------------------------------------
    def piece_keys(self) -> list[PieceKey]:
        """Every piece of the plan: dense tensors in directory order, then blobs in WSIT order."""
        return [t.name for t in self.plan.dense] + self.plan.blob_keys()

    def slot(self, key: PieceKey) -> Slot:
        """Where the plan puts a piece (the one `Slot` the tables record); InvalidInput when it has no such piece."""
        found = self._slots.get(key) if isinstance(key, (str, tuple)) else None
        if found is None:
            if isinstance(key, str):
                raise InvalidInput("tensor is not part of this model's dense directory", field="name", value=key)
            raise InvalidInput("no such (layer, expert) in this model", field="expert", value=key)
        return found

    def check_slots(self) -> None:
        """LayoutError unless every piece's slot lies inside the data region (after the header, before the metadata)
        and no two share a byte (also done when the writer is made, before the `.part` exists)."""
        check_disjoint(self._piece_regions([(k, s.offset, s.size) for k, s in self._slots.items()]),
                       self.plan.metadata_offset, "the data region")

    def _piece_regions(self, pieces: list[tuple[PieceKey, int, int]], dir_off: int | None = None,
                       wsit_off: int | None = None) -> list[Region]:
        """The header and the bytes each piece's table entry records, for `check_disjoint`: `pieces` as (key, offset,
        size), dense tensors in directory order then blobs in WSIT order; `dir_off` / `wsit_off` place the entries'
        offset fields in the file (None: the tables are not placed yet)."""
        regions = [Region("the header", 0, S.HEADER_SIZE, "header", 0)]
        d_field, w_field = DENSE_ENTRY_FIELD_OFFSETS["offset"][0], WSIT_ENTRY_FIELD_OFFSETS["offset"][0]
        n_dense = len(self.plan.dense)
        for k, (key, offset, size) in enumerate(pieces):
            if k < n_dense:
                at = None if dir_off is None else dir_off + k * S.DENSE_ENTRY_SIZE + d_field
                regions.append(Region(f"dense tensor {key!r}", offset, size, f"dense[{k}].offset", at))
            else:
                at = None if wsit_off is None else wsit_off + (k - n_dense) * S.WSIT_ENTRY_SIZE + w_field
                regions.append(Region(f"expert {key}", offset, size, f"wsit[{k - n_dense}].offset", at))
        return regions

    def stream(self, key: PieceKey, buffered: bool = False) -> PieceStream:
        """A stream that writes the piece `key` chunk by chunk; its `finish()` records the checksum. A buffered
        stream writes through the calling thread's write buffer: call `flush()` on that thread once its pieces
        are finished (their checksums count from then on)."""
        buffer = None
        if buffered:
            buffer = getattr(self._write_buffers, "buffer", None)
            if buffer is None:
                buffer = self._write_buffers.buffer = _WriteBuffer(WRITE_BUFFER_BYTES, 2 if self._dfd >= 0 else 1)
        return PieceStream(self, self.slot(key), buffer)

    def flush(self, wait: bool = True, upcoming: tuple[int, int] | None = None) -> None:
        """Write out the calling thread's write buffer, then record the checksums of the pieces finished in it.
        With direct I/O the write runs on a helper thread while the caller fills the buffer's other block;
        `wait` (the default; streams pass False when the buffer is full) returns only once every write of this
        thread's buffer is done, and raises the first that failed (its pieces never count). `upcoming`: the
        (offset, size) of the bytes the caller puts in the buffer next (`_carry_length`)."""
        buffer = getattr(self._write_buffers, "buffer", None)
        if buffer is None:
            return
        carry = self._carry_length(buffer, upcoming) if not wait else 0
        # Both taken out first: a failed write is not retried, and the pieces it held never count.
        length, buffer.length = buffer.length - carry, 0
        finished, buffer.finished = buffer.finished, []
        data = memoryview(buffer.data)[:length]
        errors = []
        if length and len(buffer.pending) > 1:
            cut = buffer.start + length
            ends_later = [self._slots[key].offset + self._slots[key].size > cut for key, _ in finished]
            carried = [f for f, later in zip(finished, ends_later) if later]
            finished = [f for f, later in zip(finished, ends_later) if not later]
            tail = buffer.data[length:length + carry]
            buffer.pending[buffer.current] = self._executor().submit(self._write_out, data, buffer.start, finished)
            self._settle(buffer.switch(), errors)  # the block about to be refilled must be written out first
            if carry:
                buffer.carry_in(cut, tail, carried)  # the old block's tail is not part of its write in flight
        elif length:
            self._write_out(data, buffer.start, finished)
        if wait:
            for i, pending in enumerate(buffer.pending):
                buffer.pending[i] = None
                self._settle(pending, errors)
        if errors:
            raise errors[0]

    def _carry_length(self, buffer: _WriteBuffer, upcoming: tuple[int, int] | None) -> int:
        """How many bytes at the end of a full buffer to keep for the next block: with direct I/O, the partial page
        after its last page boundary, when the upcoming bytes continue it and fit beside it. Written with the rest
        of their page later, they go out direct instead of as a buffered partial-page write (which ext4 serializes
        with the direct writes in flight: 2-4 ms each on the 2-core VM, 0.5-0.9 s a 3 GB conversion)."""
        if upcoming is None or len(buffer.pending) < 2:
            return 0
        end = buffer.start + buffer.length
        carry = end % DIRECT_ALIGN
        offset, size = upcoming
        if offset != end or carry >= buffer.length or carry + size > buffer.capacity:
            return 0
        return carry

    def _executor(self) -> ThreadPoolExecutor:
        with self._write_lock:
            if self._io is None:
                self._io = ThreadPoolExecutor(4, thread_name_prefix="colibri-io")
            return self._io

    @staticmethod
    def _settle(pending: Future | None, errors: list[BaseException]) -> None:
        if pending is not None:
            try:
                pending.result()
            except BaseException as exc:
                errors.append(exc)

    def _write_out(self, data: memoryview, start: int, finished: list[tuple[PieceKey, int]]) -> None:
        step = len(data) if self._dfd >= 0 else WRITE_CALL_BYTES  # direct: one write (no page-cache folios to size)
        for pos in range(0, len(data), step):
            self._write_at(data[pos:pos + step], start + pos)
        for key, checksum in finished:
            self.checksums[key] = checksum

    def _write_at(self, data: memoryview, offset: int) -> None:
        self._before_piece_write()
        data = memoryview(data).cast("B")
        n = len(data)
        head = min(n, -offset % DIRECT_ALIGN)
        whole = (n - head) // DIRECT_ALIGN * DIRECT_ALIGN
        if self._dfd < 0 or not whole or (_address(data) + head) % DIRECT_ALIGN:
            with self._write_lock:
                pwrite_all(self._fd, data, offset)
            return
        # The pages wholly inside go straight to the device (no lock: the kernel orders direct writes itself,
        # sleeping, and the thread would hold it while the device works); the partial pages at either end go
        # through the page cache, under the lock.
        if head:
            with self._write_lock:
                pwrite_all(self._fd, data[:head], offset)
        pwrite_all(self._dfd, data[head:head + whole], offset + head)
        if head + whole < n:
            with self._write_lock:
                pwrite_all(self._fd, data[head + whole:], offset + head + whole)

    def write_dense(self, name: str, array: np.ndarray) -> int:
        """Write one whole dense tensor (converted to the file's dense dtype); returns its checksum."""
        stream = self.stream(name)
        t = self._dense_index[name]
        data = to_storage(array, t.dtype)
        if tuple(data.shape) != t.shape:
            raise InvalidInput(f"tensor {name} has shape {data.shape}, expected {t.shape}", field="shape",
                               value=tuple(data.shape))
        stream.put(data)
        return stream.finish()

    def build_blob(self, arrays: dict[str, np.ndarray]) -> bytearray:
        """Pack an expert's arrays (gate_up, [gate_up_scale], down, [down_scale]) into blob bytes."""
        blob = self.plan.blob
        buf = bytearray(blob.size)
        for spec_arr in blob.arrays:
            if spec_arr.name not in arrays:
                raise InvalidInput("expert array missing", field=spec_arr.name)
            data = to_storage(arrays[spec_arr.name], spec_arr.dtype)
            if tuple(data.shape) != spec_arr.shape:
                raise InvalidInput(f"expert array {spec_arr.name} has shape {data.shape}, expected {spec_arr.shape}",
                                   field=spec_arr.name, value=tuple(data.shape))
            np.frombuffer(buf, dtype=NUMPY_STORAGE[spec_arr.dtype], count=data.size,
                          offset=spec_arr.offset)[:] = data.ravel()
        return buf

    def write_expert(self, layer: int, expert: int, arrays: dict[str, np.ndarray]) -> int:
        return self.write_expert_blob(layer, expert, self.build_blob(arrays))

    def write_expert_blob(self, layer: int, expert: int, blob: bytes | bytearray) -> int:
        """Write a packed blob at its planned slot; returns its (seeded) checksum."""
        stream = self.stream((layer, expert))
        if len(blob) != self.plan.blob.size:
            raise InvalidInput("blob has the wrong size", field="blob", value=len(blob))
        stream.put(blob)
        return stream.finish()

    # --- reading back -----------------------------------------------------------------------------
    def checksum_on_disk(self, slot: Slot) -> int:
        """XXH3-64 of the slot's bytes as the `.part` file holds them now (a short file cannot match)."""
        if self._dfd >= 0:
            return self._checksum_direct(slot)
        buf = getattr(self._read_buffers, "buf", None)
        if buf is None:  # one buffer per thread, allocated once: fresh pages are costly on some VMs
            buf = self._read_buffers.buf = memoryview(bytearray(READ_BACK_CHUNK))
        h = xxhash.xxh3_64(seed=slot.seed)
        done = 0
        while done < slot.size:
            n = os.preadv(self._fd, [buf[:min(len(buf), slot.size - done)]], slot.offset + done)
            if n <= 0:
                break
            h.update(buf[:n])
            done += n
        return h.intdigest()

    def _checksum_direct(self, slot: Slot) -> int:
        """`checksum_on_disk` through O_DIRECT: the pages around the slot are read (in large requests, into a
        page-aligned buffer of the thread's) and the slot's bytes among them hashed."""
        buf = getattr(self._read_buffers, "direct", None)
        if buf is None:
            buf = self._read_buffers.direct = memoryview(_aligned_buffer(DIRECT_READ_CHUNK))
        h = xxhash.xxh3_64(seed=slot.seed)
        end = slot.offset + slot.size
        pos = slot.offset - slot.offset % DIRECT_ALIGN
        skip = slot.offset - pos
        while pos < end:
            want = min(len(buf), -(-(end - pos) // DIRECT_ALIGN) * DIRECT_ALIGN)
            n = os.preadv(self._dfd, [buf[:want]], pos)
            use = min(n, end - pos) - skip
            if use <= 0:
                break
            h.update(buf[skip:skip + use])
            if n < want:
                break
            pos += n
            skip = 0
        return h.intdigest()

    def read_back_later(self, keys: list[PieceKey]) -> None:
        """Direct I/O only: re-hash these written pieces from the device now, on a helper thread, so that the
        read-back overlaps the rest of the conversion (`read_back_results`); a no-op otherwise."""
        if self._dfd < 0:
            return
        with self._write_lock:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="colibri-read-back")
            io = self._reader
        for key in keys:
            checksum = self.checksums.get(key)
            if checksum is not None:
                self._read_backs[key] = (checksum, io.submit(self.checksum_on_disk, self.slot(key)))

    def read_back_results(self) -> set[PieceKey]:
        """The pieces that `read_back_later` found intact and that still carry the checksum it checked."""
        ok = set()
        for key, (checksum, future) in self._read_backs.items():
            try:
                if future.result() == checksum == self.checksums.get(key):
                    ok.add(key)
            except (OSError, CancelledError):
                pass  # re-read (and reported) by the caller
        return ok

    def keep_if_intact(self, key: PieceKey, checksum: int) -> bool:
        """Resume: take over a piece an earlier run wrote, if its bytes still hash to `checksum`."""
        intact = self.checksum_on_disk(self.slot(key)) == checksum
        if intact:
            self.checksums[key] = checksum
        return intact

    def sync(self) -> None:
        fsync_fd(self._fd)

    # --- commit -----------------------------------------------------------------------------------
    def missing(self) -> list[PieceKey]:
        return [k for k in self.piece_keys() if k not in self.checksums]

    def finalize(self, metadata: dict, before_rename: Callable[[], None] = lambda: None) -> Path:
        """Write sections and header, fsync, rename over the destination, fsync the folder. `before_rename`
        runs just before the rename (the converter checks there what the rename would replace)."""
        missing = self.missing()
        if missing:
            dense = [k for k in missing if isinstance(k, str)]
            experts = [k for k in missing if not isinstance(k, str)]
            raise WriteError(f"cannot finalize: {len(dense)} dense tensors and {len(experts)} experts not written",
                             field="missing", value=(dense[:3], experts[:3]))
        S.check_metadata(metadata)
        if metadata["model"] != self.model:
            raise InvalidInput("metadata model differs from the model the file was planned for", field="model")
        if metadata["quantization"]["experts"] != S.EXPERT_FORMAT_NAMES[self.expert_format]:
            raise InvalidInput("metadata quantization.experts differs from the expert format",
                               field="quantization.experts", value=metadata["quantization"]["experts"])
        meta_raw = S.encode_metadata(metadata)
        if len(meta_raw) > S.MAX_METADATA_BYTES:
            raise InvalidInput(f"the metadata takes {len(meta_raw):,} bytes, over the {S.MAX_METADATA_BYTES:,}-byte "
                               "limit of the .colibri metadata section", field="metadata_size", value=len(meta_raw))
        header = self._write_sections(meta_raw)
        pwrite_all(self._fd, header.pack(), 0)
        fsync_fd(self._fd)  # the inode's data, whichever descriptor wrote it
        self._close_direct()
        os.close(self._fd)
        self._fd = -1
        before_rename()
        atomic_replace(self.part_path, self.path)
        return self.path

    def _write_sections(self, meta_raw: bytes) -> S.Header:
        plan = self.plan
        dir_off, wsit_off, wsit_size, file_size = plan.sections(len(meta_raw), len(plan.dense))
        # The entries record the very slots the pieces' streams were bounded by (`slot`).
        dense = [S.DenseEntry(t.name, int(t.dtype), len(t.shape), 0, t.shape, s.offset, s.size, self.checksums[s.key])
                 for t, s in ((t, self._slots[t.name]) for t in plan.dense)]
        blobs = [S.WsitEntry(*s.key, s.offset, s.size, self.checksums[s.key])
                 for s in (self._slots[key] for key in plan.blob_keys())]
        directory = b"".join(e.pack() for e in dense)
        wsit = b"".join(e.pack() for e in blobs)
        # Before the first byte of the sections: every piece the tables record, the header and the sections lie
        # inside the file and share no byte (convert/verify.py says why the early read-back relies on this).
        regions = self._piece_regions([(e.name, e.offset, e.size) for e in dense]
                                      + [((e.layer, e.expert), e.offset, e.size) for e in blobs], dir_off, wsit_off)
        regions += [Region("the metadata", plan.metadata_offset, dir_off - plan.metadata_offset, "metadata_offset",
                           HEADER_FIELD_OFFSETS["metadata_offset"][0]),
                    Region("the dense directory", dir_off, len(directory), "dense_dir_offset",
                           HEADER_FIELD_OFFSETS["dense_dir_offset"][0]),
                    Region("the WSIT", wsit_off, len(wsit), "wsit_offset", HEADER_FIELD_OFFSETS["wsit_offset"][0])]
        check_disjoint(regions, file_size)
        os.ftruncate(self._fd, file_size)
        pwrite_all(self._fd, meta_raw, plan.metadata_offset)
        meta_end = plan.metadata_offset + len(meta_raw)
        pwrite_all(self._fd, bytes(dir_off - meta_end), meta_end)
        pwrite_all(self._fd, directory, dir_off)
        pwrite_all(self._fd, wsit, wsit_off)
        m = self.model
        return S.Header(
            magic=S.MAGIC, version_major=S.VERSION_MAJOR, version_minor=S.minor_version_for(self.expert_format), flags=0,
            file_size=file_size, alignment=S.BLOB_ALIGNMENT, num_layers=m["num_layers"],
            num_moe_layers=len(plan.moe_layers), num_experts=plan.num_experts, top_k=m["top_k"],
            num_dense_tensors=len(plan.dense), hidden_size=m["hidden_size"],
            expert_intermediate_size=m["expert_intermediate_size"], expert_format=int(self.expert_format),
            reserved0=0, group_size=self.group_size, expert_blob_size=plan.blob.size, data_offset=S.DATA_OFFSET,
            experts_offset=plan.experts_offset, metadata_offset=plan.metadata_offset,
            metadata_size=len(meta_raw),
            metadata_checksum=digest(meta_raw, section_seed(S.Section.METADATA, plan.metadata_offset)),
            dense_dir_offset=dir_off, dense_dir_size=len(directory),
            dense_dir_checksum=digest(directory, section_seed(S.Section.DENSE_DIRECTORY, dir_off)),
            wsit_offset=wsit_off, wsit_size=wsit_size,
            wsit_checksum=digest(wsit, section_seed(S.Section.WSIT, wsit_off)))

    def abort(self, remove_part: bool = False) -> bool:
        """Close the `.part`; with `remove_part`, also remove it, but only while its name still holds the file
        this writer opened (never a file put there by someone else meanwhile). Returns whether it was removed."""
        self._close_direct()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        return remove_part and unlink_if_ours(self.part_path, self._part_id)

    def _close_direct(self) -> None:
        # writes still in flight (after an error) end before their descriptor; queued read-backs are dropped
        for pool in (self._io, self._reader):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=pool is self._reader)
        self._io = self._reader = None
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1

    def __enter__(self) -> ColibriWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if self._fd >= 0:
            self.abort(remove_part=False)

"""The resume journal and the single-writer lock of `colibri convert`.

The journal (`.<name>.journal` beside the destination) is append-only. Each record is framed as
`len (u64) | xxh3(len) | payload | xxh3(payload)`, so a record torn by a crash fails its own checks and is
dropped together with anything after it. Payloads are compact JSON. The first record is the header: a
fingerprint of the inputs and the options; every later record says that one piece (a dense tensor or an
expert blob) reached the `.part` file durably, with the checksum it had.

Records are appended only after the data they describe was fsynced, and the journal is fsynced after each
batch, so a record can never describe data that a power cut lost.

No link planted at the journal's or the lock's name is ever followed: the journal is written as a fresh file
(O_EXCL | O_NOFOLLOW) and renamed over its name, then appended through the same descriptor; the lock is
created O_EXCL (which never follows a link), and a lock that is not a regular file is stale.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from colibri_format.convert import crashpoint
from colibri_format.errors import ResumeError, WriteError
from colibri_format.fsutil import create_fresh, file_id, fsync_dir, fsync_fd, unlink_if_ours

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MAX_RECORD_BYTES = 16 << 20     # a record describes one piece; anything bigger is garbage
_LEN = struct.Struct("<QQ")     # len, xxh3(len)
_SUM = struct.Struct("<Q")


def journal_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.journal")


def lock_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


# --- framing --------------------------------------------------------------------------------------
def frame(payload: dict[str, Any]) -> bytes:
    try:
        body = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except ValueError:  # NaN or infinity: JSON has no spelling for them, and a journal must read back
        what = payload.get("name", [payload.get("layer"), payload.get("expert")])
        raise WriteError(f"cannot journal the {payload.get('kind')} record {what}: it holds a non-finite number",
                         field="journal") from None
    head = struct.pack("<Q", len(body))
    return (_LEN.pack(len(body), xxhash.xxh3_64_intdigest(head)) + body
            + _SUM.pack(xxhash.xxh3_64_intdigest(body)))


def parse_records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The intact records at the start of `data` and the byte length they cover (the rest is torn)."""
    records, pos = [], 0
    while pos + _LEN.size <= len(data):
        length, length_sum = _LEN.unpack_from(data, pos)
        if length_sum != xxhash.xxh3_64_intdigest(data[pos:pos + 8]) or length > MAX_RECORD_BYTES:
            break
        end = pos + _LEN.size + length + _SUM.size
        if end > len(data):
            break
        body = data[pos + _LEN.size:end - _SUM.size]
        (body_sum,) = _SUM.unpack_from(data, end - _SUM.size)
        if body_sum != xxhash.xxh3_64_intdigest(body):
            break
        try:
            record = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            break
        if not isinstance(record, dict):
            break
        records.append(record)
        pos = end
    return records, pos


# --- the journal file -----------------------------------------------------------------------------
@dataclass
class JournalState:
    """What an existing journal says: its header and the pieces it lists as durably written."""

    header: dict[str, Any] | None
    pieces: list[dict[str, Any]]
    ident: tuple[int, int] | None = None  # (device, inode) of the journal read, to remove no other file later


def read_journal(path: Path, max_bytes: int = 1 << 30) -> JournalState:
    """Read a journal; a missing or headerless one reads as empty, and so does anything at its name that is
    not a regular file (a planted symlink is not followed: it is not a journal we wrote). Never trusts it
    beyond its checksums."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return JournalState(None, [])
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return JournalState(None, [])
        raise ResumeError(f"cannot read the resume journal {path.name}: {exc.strerror}; use --restart",
                          field="journal") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return JournalState(None, [])
        if st.st_size > max_bytes:
            raise ResumeError("the resume journal is implausibly large; use --restart", field="journal",
                              value=st.st_size)
        try:
            data = fh.read(st.st_size)
        except OSError as exc:
            raise ResumeError(f"cannot read the resume journal: {exc.strerror}", field="journal") from None
    records, _ = parse_records(data)
    if not records or records[0].get("kind") != "header":
        return JournalState(None, [])
    return JournalState(records[0], [r for r in records[1:] if r.get("kind") in ("dense", "expert")],
                        (st.st_dev, st.st_ino))


class Journal:
    """An open journal: created fresh (header plus already verified pieces), then appended batch by batch."""

    def __init__(self, path: Path, header: dict[str, Any], pieces: list[dict[str, Any]]) -> None:
        self.path = path
        tmp = path.with_name(path.name + ".new")
        # A fresh file written whole and renamed in: the old journal stays valid until the rename. Appends go
        # through the same descriptor, so the name is never opened again (nothing planted there is followed).
        fd = create_fresh(tmp, os.O_WRONLY | os.O_APPEND)
        self._id = file_id(fd)
        try:
            _write_all(fd, b"".join(frame(r) for r in [header, *pieces]))
            crashpoint.hit("journal-fsync")
            fsync_fd(fd)
            crashpoint.hit("journal-rename")
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise WriteError(f"cannot install the resume journal: {exc.strerror}") from None
            fsync_dir(path.parent)
        except BaseException:
            os.close(fd)
            unlink_if_ours(tmp, self._id)  # the old journal (if any) is still in place; the new one never was
            raise
        self._fd = fd
        self.pieces = len(pieces)  # piece records durably in the journal

    def append(self, pieces: list[dict[str, Any]]) -> None:
        """Append records for pieces whose data is already fsynced, then make them durable."""
        if not pieces:
            return
        crashpoint.hit("journal-append")
        _write_all(self._fd, b"".join(frame(p) for p in pieces))
        crashpoint.hit("journal-fsync")
        fsync_fd(self._fd)
        self.pieces += len(pieces)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> bool:
        """Close and remove the journal, only while its name still holds the file written here. Returns whether
        it was removed."""
        self.close()
        return unlink_if_ours(self.path, self._id)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except OSError as exc:
            raise WriteError(f"cannot write the resume journal: {os.strerror(exc.errno or errno.EIO)}",
                             field="journal") from None
        if n <= 0:
            raise WriteError("cannot write the resume journal (disk full or file size limit?)", field="journal")
        view = view[n:]


# --- the lock -------------------------------------------------------------------------------------
UNREADABLE_LOCK_GRACE_S = 10.0  # a lock without a pid may be one being created right now


class WriterLock:
    """`O_CREAT|O_EXCL` lock file holding the writer's pid; a lock whose pid is gone is stale and taken over."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._held = False

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            except FileExistsError:
                self._break_if_stale()
                continue
            except OSError as exc:
                raise WriteError(f"cannot create the lock file {self.path.name}: {exc.strerror}") from None
            self._id = file_id(fd)
            try:
                _write_all(fd, f"{os.getpid()}\n".encode())
            except BaseException:
                unlink_if_ours(self.path, self._id)  # a lock without a pid would hold others off for a while
                raise
            finally:
                os.close(fd)
            self._held = True
            return
        raise WriteError(f"cannot take the lock file {self.path.name}", field="lock")

    def _break_if_stale(self) -> None:
        if not _is_regular(self.path):  # not a lock we make (a planted link): stale; unlinking it spares its target
            self._remove()
            return
        pid = _lock_pid(self.path)
        if pid is None:
            if time.time() - _mtime(self.path) < UNREADABLE_LOCK_GRACE_S:
                raise WriteError(f"{self.path.name} is being created by another writer; try again",
                                 field="lock")
        elif _pid_alive(pid):
            raise WriteError(f"another conversion (pid {pid}) is writing this output; if that is wrong, "
                             f"delete {self.path}", field="lock", value=pid)
        self._remove()  # stale: its writer is gone

    def _remove(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:  # e.g. a directory in the way
            raise WriteError(f"cannot remove the stale lock {self.path.name}: {exc.strerror}", field="lock",
                             value=str(self.path)) from None

    def release(self) -> None:
        if self._held:
            unlink_if_ours(self.path, self._id)  # only the lock this writer made, never one put there since
            self._held = False


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True  # gone meanwhile: nothing to break, the next create decides
    except OSError:
        return False


def _lock_pid(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        text = os.read(fd, 32).decode("ascii").strip()
        pid = int(text)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    finally:
        os.close(fd)
    return pid if 0 < pid < 1 << 31 else None


def _mtime(path: Path) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True

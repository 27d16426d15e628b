"""Crash-safe file primitives: checked positional writes, fsync, atomic rename with a directory fsync, and
opening the converter's own files (`.part`, journal, lock) without following a link planted at their name, and
removing them only while the name still holds the file we opened.

A symbolic link (or a hard link) put where one of our temporary files belongs must never make us write into
its target: a fresh file replaces whatever name is there (unlinking a link removes the link, not its target)
and is created with O_EXCL | O_NOFOLLOW; an existing file is reused only when it is a regular file that no
other name shares.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import WriteError


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write every byte at `offset`; a short write is retried, an error is a WriteError."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            raise WriteError(f"write failed: {os.strerror(exc.errno or errno.EIO)}", field="offset",
                             value=offset + done) from None
        if n <= 0:
            raise WriteError("write made no progress (disk full or file size limit?)", field="offset",
                             value=offset + done)
        done += n


def fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        # A failed fsync is not retryable (the kernel may have dropped the dirty pages): fail the job.
        raise WriteError(f"fsync failed: {os.strerror(exc.errno or errno.EIO)}") from None


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def atomic_replace(part: Path, final: Path) -> None:
    """Rename the synced part file over the destination, then make the rename durable."""
    try:
        os.replace(part, final)
    except OSError as exc:
        raise WriteError(f"cannot rename {part.name} to {final.name}: {exc.strerror}") from None
    fsync_dir(final.parent)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def create_fresh(path: Path, flags: int = os.O_RDWR, mode: int = 0o644) -> int:
    """A new, empty regular file at `path`, whatever was there before (a file, a symlink, a hard link to
    another file: the name is unlinked, never the target written). Created O_EXCL | O_NOFOLLOW, so a link
    planted between the unlink and the create makes the create fail rather than follow it."""
    for _ in range(8):
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
        except FileExistsError:
            pass
        except OSError as exc:
            raise WriteError(f"cannot create {path.name}: {exc.strerror}") from None
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                raise WriteError(f"cannot create {path.name}: a directory is in the way", field="path",
                                 value=str(path))
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise WriteError(f"cannot replace {path.name}: {exc.strerror}") from None
    raise WriteError(f"cannot create {path.name}: something keeps re-creating it", field="path", value=str(path))


def open_private(path: Path, flags: int = os.O_RDWR) -> int | None:
    """Open an existing file of ours without following a link: None when it is missing, a symbolic link,
    not a regular file, or shares its inode with another name (a planted hard link)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK)
    except OSError:  # ENOENT, ELOOP (a symlink), EISDIR, ENXIO (a FIFO without a writer), EACCES, ...
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return fd



def file_id(fd: int) -> tuple[int, int]:
    """(device, inode) of an open file: what `unlink_if_ours` compares the name against."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def unlink_if_ours(path: Path, ident: tuple[int, int]) -> bool:
    """Remove `path` only while it still names the regular file `ident` (`file_id` of a file this process created
    or took over): a file that someone else put at the name meanwhile is left alone. Returns whether it was
    removed."""
    try:
        there = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(there.st_mode) or (there.st_dev, there.st_ino) != ident:
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True

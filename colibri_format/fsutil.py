"""Crash-safe file primitives: checked positional writes, fsync, atomic rename with a directory fsync."""

from __future__ import annotations

import errno
import os
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

"""What `colibri convert` may replace at its output path: nothing but a `.colibri` file, and that only when asked.

The rules, checked before the first byte is written and again just before the final rename:

- nothing there: fine;
- a symbolic link: refused (the converter never writes through a link; give the real path);
- a directory, FIFO, device or socket: refused;
- one of the checkpoint's own files (same device and inode, so also through a hard link or a linked folder):
  refused, even with --force;
- a regular file that does not start with the `.colibri` magic: refused, even with --force (it is not ours);
- a `.colibri` file: replaced only with `force=True`; the error says so.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from colibri_format import spec as S
from colibri_format.errors import OutputPathRefused

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
FileId = tuple[int, int]  # (st_dev, st_ino)


def source_file_ids(root: Path, names: Iterable[str]) -> dict[FileId, str]:
    """(device, inode) -> name of each of the checkpoint's files `names` that exists (links followed, so a
    hub-cache blob counts under its snapshot name). Only files the converter reads count: a `.colibri` written
    into the checkpoint folder earlier may be replaced (with force) like any other."""
    ids: dict[FileId, str] = {}
    for name in names:
        try:
            st = os.stat(root / name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            ids.setdefault((st.st_dev, st.st_ino), name)
    return ids


def has_colibri_magic(path: Path) -> bool:
    """Whether the regular file at `path` starts with the `.colibri` magic field (opened without following a
    link, and without blocking on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.pread(fd, S.MAGIC_FIELD_SIZE, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return head == S.MAGIC + bytes(S.MAGIC_FIELD_SIZE - len(S.MAGIC))


def check_output_path(dest: Path, sources: dict[FileId, str], *, force: bool) -> None:
    """Raise OutputPathRefused unless writing `dest` can only replace a `.colibri` file (with `force`)."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputPathRefused(f"cannot check the output path: {exc.strerror}", field="output_path",
                                value=str(dest)) from None
    if stat.S_ISLNK(st.st_mode):
        raise OutputPathRefused("the output path is a symbolic link; the converter never writes through one: "
                                "give the real path", field="output_path", value=str(dest))
    if stat.S_ISDIR(st.st_mode):
        raise OutputPathRefused("--output-path is a directory; give a file name", field="output_path",
                                value=str(dest))
    if not stat.S_ISREG(st.st_mode):
        raise OutputPathRefused("the output path exists and is not a regular file", field="output_path",
                                value=str(dest))
    source = sources.get((st.st_dev, st.st_ino))
    if source is not None:
        raise OutputPathRefused(f"the output path is the checkpoint's own {source}; refusing to replace it",
                                field="output_path", value=str(dest))
    if not has_colibri_magic(dest):
        raise OutputPathRefused("the output path holds a file that is not a .colibri file; refusing to replace "
                                "it (delete it or choose another path)", field="output_path", value=str(dest))
    if not force:
        raise OutputPathRefused("the output file already exists; pass --force to replace it",
                                field="output_path", value=str(dest))

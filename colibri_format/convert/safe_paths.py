"""Opening files named by an untrusted checkpoint without leaving its folder.

A shard name comes from `model.safetensors.index.json`, i.e. from whoever made
the checkpoint. We accept a plain basename only, resolve it, and insist that the
resolved file is a regular file inside the checkpoint folder. The one symlink
layout we follow is the Hugging Face hub cache, where
`snapshots/<rev>/<name>` links to `../../blobs/<hash>`.

Unlike the `.colibri` reader we do not refuse hard links (st_nlink > 1): a hard
link can only be made by someone who could already read the file, and dedup
tools and `cp -l` copies of checkpoints use them legitimately.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from colibri_format.errors import InvalidInput

# A basename: no separators, no leading dot (so no "." or ".."), bounded length.
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")


def short_repr(value: object, limit: int = 60) -> str:
    """repr() cut to `limit` characters: an untrusted value must not flood an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_basename(name: object, *, field: str) -> str:
    """Return `name` if it is a safe plain file name, else raise InvalidInput."""
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or ".." in name:
        raise InvalidInput(f"{field}: {short_repr(name)} is not a plain file name", field=field, value=name)
    return name


def _is_hub_cache_blob(root: Path, target: Path) -> bool:
    # HF hub cache: <repo>/snapshots/<rev>/file -> <repo>/blobs/<sha>.
    blobs = root.parent.parent / "blobs"
    return root.parent.name == "snapshots" and target.parent == blobs


def resolve_member(root: Path, name: str, *, field: str) -> Path:
    """Resolve `root/name` to a regular file that does not escape `root`."""
    check_basename(name, field=field)
    real_root = Path(os.path.realpath(root))
    candidate = real_root / name
    target = Path(os.path.realpath(candidate))
    if target.parent != real_root and not _is_hub_cache_blob(real_root, target):
        raise InvalidInput(f"{field}: {name!r} resolves outside the checkpoint folder",
                           field=field, value=name)
    try:
        st = os.stat(target)
    except OSError as exc:
        raise InvalidInput(f"{field}: cannot open {name!r}: {exc.strerror}", field=field, value=name) from exc
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInput(f"{field}: {name!r} is not a regular file", field=field, value=name)
    return target


def read_capped(path: Path, *, max_bytes: int, field: str) -> bytes:
    """Read a whole small file, refusing it before allocating if it is over the cap."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise InvalidInput(f"{field}: cannot open {path.name!r}: {exc.strerror}", field=field) from exc
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise InvalidInput(f"{field}: {path.name!r} is {size} bytes, over the {max_bytes}-byte cap",
                               field=field, value=size)
        data = fh.read(size + 1)
    if len(data) != size:
        raise InvalidInput(f"{field}: {path.name!r} changed size while being read", field=field)
    return data

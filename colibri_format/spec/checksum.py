"""Checksums of the `.colibri` v1 format: XXH3-64, seeded with where the bytes belong.

Seeding each digest with its context (section kind, tensor name, layer/expert ids and the offset)
means a block copied into the wrong slot fails its check even though its own bytes are intact.
"""

from __future__ import annotations

import struct

import xxhash

from . import constants as C

_SECTION_TAGS = {C.Section.METADATA: b"META", C.Section.DENSE_DIRECTORY: b"DDIR", C.Section.WSIT: b"WSIT"}


def header_checksum(header_bytes: bytes) -> int:
    """XXH3-64 with seed 0 over bytes 0..503 of the header."""
    return xxhash.xxh3_64_intdigest(memoryview(header_bytes)[:C.HEADER_CHECKED_SIZE])


def section_seed(section: C.Section, offset: int) -> int:
    return xxhash.xxh3_64_intdigest(_SECTION_TAGS[section] + struct.pack("<Q", offset))


def dense_seed(name: str, offset: int) -> int:
    return xxhash.xxh3_64_intdigest(b"DENS" + name.encode("utf-8") + b"\0" + struct.pack("<Q", offset))


def expert_seed(layer: int, expert: int, offset: int) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack("<4sIIQ", b"EXPT", layer, expert, offset))


def digest(data, seed: int) -> int:
    """XXH3-64 of a bytes-like object (memoryview, mmap slice, ndarray) with the given seed."""
    return xxhash.xxh3_64_intdigest(data, seed=seed)


class StreamingDigest:
    """Incremental XXH3-64, for checking large blocks in chunks (progress bars, bounded reads)."""

    def __init__(self, seed: int) -> None:
        self._h = xxhash.xxh3_64(seed=seed)

    def update(self, data) -> None:
        self._h.update(data)

    def intdigest(self) -> int:
        return self._h.intdigest()

"""The converter's compiled loops (`_native.c`), when `pip install` could build them; NumPy otherwise.

`pip install` builds `_native.c` into `colibri_format/convert/_native*.so` where a C compiler is there (an optional
extension: without one the install goes on and the converter runs its NumPy loops, which write the same bytes,
only slower; a build older than `_native.c` is ignored too). The library has no Python module in it: it is found
by the extension's file name and called through ctypes, one call per chunk, with the pointers of arrays the caller
checked (`quantize.py`, `cast.py`, `derived.py`).

`COLIBRI_NO_NATIVE=1` in the environment keeps the NumPy loops (for comparing the two; tests patch `library`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
from pathlib import Path

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "colibri_group_max_bits16": [_PTR, _I64, _I64, _PTR],
    "colibri_group_max_bits32": [_PTR, _I64, _I64, _PTR],
    "colibri_quantize_bf16": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR],
    "colibri_quantize_f32": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR],
    "colibri_quantize4_bf16": [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR],
    "colibri_quantize4_f32": [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR],
    "colibri_quantize4_search_bf16": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR],
    "colibri_quantize4_search_f32": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR],
    "colibri_bf16_to_f16": [_PTR, _I64, _PTR],
    "colibri_fp8_rows": [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR],
}
_RESULTS = {"colibri_bf16_to_f16": _I64}


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled loops, or None (not built, unloadable, or COLIBRI_NO_NATIVE set)."""
    if os.environ.get("COLIBRI_NO_NATIVE"):
        return None
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_native{suffix}"
        if path.is_file() and not _older_than_source(path):
            try:
                lib = ctypes.CDLL(str(path))
                for name, args in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, _RESULTS.get(name)
            except (OSError, AttributeError):  # built for another machine, or an older build: the NumPy loops
                return None
            return lib
    return None


def _older_than_source(path: Path) -> bool:
    """A build older than `_native.c` beside it (edited since the install: `make` rebuilds it) is not trusted; an
    installed wheel has no source beside its build."""
    source = path.parent / "_native.c"
    return source.is_file() and path.stat().st_mtime < source.stat().st_mtime

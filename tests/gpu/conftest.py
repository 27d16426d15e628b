"""GPU tests: everything under tests/gpu is marked `gpu` and skipped, with a visible reason, when CuPy or a CUDA
device is missing (CI machines have none)."""

from __future__ import annotations

import functools

import pytest

SKIP_REASON = "no CUDA GPU / CuPy available"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and CuPy (skipped otherwise)")


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- any import or driver failure means "no GPU here"
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if not gpu_available():
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))

"""GPU tests: every `test_gpu_*.py` module is marked `gpu` and skipped, with a visible reason, when CuPy or a
CUDA device is missing (CI machines have none). Run them all on a GPU machine with `pytest -m gpu`. The fixtures
the GPU test modules share: `cp` (the CuPy module) and `rng` (fresh inputs every run, reproducible from the
printed seed when a test fails); and for the CPU twins of layers.cu's and fused.cu's norm kernels, `norm_emulator`
(both modules compiled for the host once a test module)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

SKIP_REASON = "no CUDA GPU / CuPy available"


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- any import or driver failure means "no GPU here"
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not item.path.name.startswith("test_gpu_"):
            continue
        item.add_marker(pytest.mark.gpu)
        if not gpu_available():
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy % (2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def norm_emulator(tmp_path_factory):
    from tests.runtime.cuda.cuda_host_emulation import NormEmulator, build_fused, build_layers

    return NormEmulator(build_layers(tmp_path_factory.mktemp("layers_host")),
                        build_fused(tmp_path_factory.mktemp("fused_host")))

"""Every CUDA kernel source compiles for sm_90 with nvcc (CPU-only: no GPU needed, only the CUDA compiler).

Each module is compiled as NVRTC sees it at run time: `ops.kernel_source` (common.cuh inlined) with
`ops.compile_options` (the tile and thread constants of runtime/cuda/limits.py as -D options), in parallel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA compiler) not on PATH")
REPO = Path(__file__).resolve().parents[3]


def _nvcc(name: str, tmp_path, mode: list[str], options: tuple[str, ...]) -> subprocess.CompletedProcess:
    src = tmp_path / f"{name}.cu"
    src.write_text(ops.kernel_source(name))
    cmd = [NVCC, "-arch=sm_90", *options, *mode, str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _compile(name: str, tmp_path) -> subprocess.CompletedProcess:
    return _nvcc(name, tmp_path, ["--resource-usage", "-cubin", "-o", str(tmp_path / f"{name}.cubin")],
                 ops.compile_options(name))


@needs_nvcc
def test_every_kernel_module_compiles(tmp_path):
    with ThreadPoolExecutor(max_workers=len(ops.MODULES)) as pool:
        results = dict(zip(ops.MODULES, pool.map(lambda n: _compile(n, tmp_path), ops.MODULES)))
    for name, res in results.items():
        assert res.returncode == 0, f"{name}.cu failed to compile:\n{res.stderr[-4000:]}"
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", res.stderr)]
        assert max(spills, default=0) <= 64, f"{name}.cu spills registers heavily:\n{res.stderr}"
        assert (tmp_path / f"{name}.cubin").stat().st_size > 0


@needs_nvcc
def test_a_wider_split_cap_compiles(tmp_path):
    """layers.cu with the wider split cap benchmarks/attention_decode.py times by --define ATT_MAX_SPLITS=256: it
    builds for sm_90 without heavy spills."""
    from colibri_format.runtime.cuda import limits

    options = {**limits.KERNEL_DEFINES["layers"], "ATT_MAX_SPLITS": 256}
    res = _nvcc("layers", tmp_path, ["--resource-usage", "-cubin", "-o", str(tmp_path / "layers.cubin")],
                tuple(o for o in ops.compile_options("layers") if not o.startswith("-D"))
                + tuple(f"-D{k}={v}" for k, v in options.items()))
    assert res.returncode == 0, res.stderr[-4000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", res.stderr)]
    assert max(spills, default=0) <= 64, res.stderr


@needs_nvcc
@pytest.mark.parametrize("name", ops.MODULES)
def test_a_missing_define_stops_the_compile(name, tmp_path):
    res = _nvcc(name, tmp_path, ["-E", "-o", os.devnull], ops.NVRTC_OPTIONS)   # no -D options
    assert res.returncode != 0
    for define in limits.KERNEL_DEFINES[name]:
        assert f"{define} undefined" in res.stderr, f"{name}.cu compiles without -D{define}:\n{res.stderr[-2000:]}"


@needs_nvcc
@pytest.mark.parametrize("define,value", [("ROUTER_MAX_K", 64), ("ROUTER_MAX_E", 1024)])
def test_router_capabilities_match_its_instantiations(define, value, tmp_path):
    """limits.py cannot declare more experts or a larger top_k than router.cu is built for (with limits.py's own
    values it compiles: test_every_kernel_module_compiles)."""
    options = tuple(o for o in ops.compile_options("router") if not o.startswith(f"-D{define}="))
    bad = _nvcc("router", tmp_path, ["-cuda", "-o", os.devnull], options + (f"-D{define}={value}",))
    assert bad.returncode != 0 and "static assertion failed" in bad.stderr, bad.stderr[-2000:]


def test_sources_have_no_includes_left():
    for name in ops.MODULES:
        assert "#include" not in ops.kernel_source(name), name


def test_kernel_constants_are_defined_only_in_python():
    every = {d for defines in limits.KERNEL_DEFINES.values() for d in defines}
    for name, defines in limits.KERNEL_DEFINES.items():
        src = ops.kernel_source(name)
        for define in every:
            assert not re.search(rf"#\s*define\s+{define}\b", src), f"{name}.cu defines {define} itself"
        for define in defines:
            assert re.search(rf"#ifndef {define}\n#error", src), f"{name}.cu has no #error guard for {define}"
            uses = len(re.findall(rf"\b{define}\b", src)) - 2   # beyond the guard
            assert uses > 0, f"{name}.cu is passed -D{define} but never uses it"
        assert ops.compile_options(name)[-len(defines):] == tuple(f"-D{d}={v}" for d, v in defines.items())


def test_ops_imports_without_cupy():
    """With cupy unimportable, ops and limits still import, and a kernel call fails on the import."""
    code = "\n".join([
        "import sys",
        "sys.modules['cupy'] = None   # any 'import cupy' now raises ImportError",
        "from colibri_format.runtime.cuda import limits",
        "from colibri_format.runtime.cuda.kernels import ops",
        "assert ops.GEMM_BM == limits.GEMM_BM and ops.MODULES",
        "try:",
        "    ops.module('router')",
        "except ImportError:",
        "    print('cupy blocked')",
        "else:",
        "    raise SystemExit('ops.module ran without cupy')",
    ])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.strip() == "cupy blocked"


def test_forget_module_drops_that_modules_code_only(monkeypatch):
    """ops.forget_module (a rebuild with other -D constants) empties the caches of one module, on every device."""
    monkeypatch.setattr(ops, "_MODULES", {("router", 0): "m", ("router", 1): "m1", ("layers", 0): "l"})
    monkeypatch.setattr(ops, "_FUNCTIONS", {("router", "moe_router_f32_e32", 0): "f", ("layers", "rmsnorm", 0): "g"})
    ops.forget_module("router")
    assert ops._MODULES == {("layers", 0): "l"}
    assert ops._FUNCTIONS == {("layers", "rmsnorm", 0): "g"}

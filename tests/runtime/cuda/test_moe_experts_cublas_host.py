"""ops.moe_experts_cublas' order of work, checked without a GPU: the launches that need no per-expert count are
queued before the host reads the counts (a synchronization), so that the device is not left idle while the host
queues them after the wait, every layer of an eager pass. CuPy is stood in for by host arrays and the kernel
wrappers by recorders; the products themselves are tested on the GPU in test_gpu_moe_gemm_cublas.py."""

from __future__ import annotations

import types

import numpy as np
import pytest

from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda.host_arrays import HostArray

E, T, K_TOP, H, I = 4, 3, 2, 32, 16


@pytest.fixture
def record(monkeypatch):
    """The names of the calls moe_experts_cublas makes, in order; 'counts read' where it copies the dispatch's
    offsets to the host."""
    events: list[str] = []
    stream = types.SimpleNamespace(ptr=77, is_capturing=lambda: False)

    def asnumpy(a):
        events.append("counts read" if a is DISPATCH.offsets else "table read")
        return a.host

    fake = types.SimpleNamespace(ndarray=HostArray, int32=np.int32, float32=np.float32, uint16=np.uint16,
                                 empty=lambda shape, dtype=np.float32: np.zeros(shape, dtype),   # sliced, unchecked
                                 asnumpy=asnumpy,
                                 cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                                            get_current_stream=lambda: stream))
    monkeypatch.setattr(ops, "_cupy", lambda: fake)

    def recorder(name, result):
        def call(*args, **kwargs):
            events.append(name)
            return result(*args) if callable(result) else result
        return call

    rows = HostArray(np.zeros((T * K_TOP, H), np.int8)), HostArray(np.ones(T * K_TOP, np.float32))
    monkeypatch.setattr(ops, "quantize_rows_int8", recorder("quantize_rows_int8", rows))
    monkeypatch.setattr(ops, "gather_rows_int8", recorder("gather_rows_int8", rows))
    monkeypatch.setattr(ops, "gather_bf16", recorder("gather_bf16", np.zeros((2 * T * K_TOP, H), np.uint16)))
    monkeypatch.setattr(ops, "_experts_int8", recorder("products", None))
    for name in ("widen_expert_bf16", "gemm_bf16", "gate_up_epilogue", "down_epilogue"):
        monkeypatch.setattr(ops, name, recorder("products", None))
    monkeypatch.setattr(ops, "moe_combine", recorder("moe_combine", None))
    return events


def _dispatch() -> ops.Dispatch:
    counts = np.array([2, 0, 3, 1], np.int32)
    arrays = {"counts": counts, "offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
              "perm": np.arange(T * K_TOP, dtype=np.int32), "inv": np.arange(T * K_TOP, dtype=np.int32),
              "active": np.array([0, 2, 3, -1], np.int32), "meta": np.zeros(4, np.int32),
              "tile_expert": np.zeros(1, np.int32), "tile_start": np.zeros(1, np.int32)}
    return ops.Dispatch(**{k: HostArray(v) for k, v in arrays.items()}, num_pairs=T * K_TOP, num_experts=E,
                        tile_m=ops.GEMM_BM)


DISPATCH = _dispatch()


@pytest.mark.parametrize("activations, first", [("int8", ["quantize_rows_int8", "gather_rows_int8"]),
                                                ("split", ["gather_bf16"]), ("bf16", ["gather_bf16"])])
def test_launches_that_need_no_count_are_queued_before_the_counts_are_read(record, activations, first):
    table = ops.ExpertTable.from_layout(HostArray(np.arange(1, E + 1, dtype=np.uint64)),
                                        ops.blob_layout(H, I, ops.ExpertFormat.INT8_ROW))
    x = HostArray(np.zeros((T, H), np.float32))
    ids = HostArray(np.zeros((T, K_TOP), np.int32))
    ypair = HostArray(np.zeros((T * K_TOP, H), np.float32))
    ops.moe_experts_cublas(x, ids, np.ones((T, K_TOP), np.float32), table, DISPATCH,
                           activations=activations, ypair=ypair)
    assert record[:len(first) + 1] == [*first, "counts read"]
    assert "products" in record and record[-1] == "moe_combine"

"""The CUDA backend: the decoder's ops on the kernels of `cuda/kernels`, and the one door to CuPy (arrays,
streams, events, copies, host registration, graph capture).

It offers the same methods as `runtime.numpy_backend.NumpyBackend`, so one decoder, one expert pool and one engine
run on either. CuPy is imported only here and in `kernels/ops.py`, and only when a backend is built.
"""

from __future__ import annotations

import contextlib

import numpy as np

from colibri_format.errors import InvalidInput
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.limits import (ATT_DECODE_MAX_ROWS, ATTENTION_HEAD_DIMS, NORM_ROUTE_MAX_ROWS,
                                                 ROUTER_GEMM_MIN_ROWS, check_cuda_support)
from colibri_format.spec.constants import PACKED_FORMATS

HOST_REGISTER_READ_ONLY = 8     # cudaHostRegisterReadOnly: lets a PROT_READ file mapping be pinned
MEMCPY_HOST_TO_DEVICE = 1       # cudaMemcpyHostToDevice
MEMCPY_DEVICE_TO_HOST = 2       # cudaMemcpyDeviceToHost



class CupyBackend:
    """CuPy arrays on one device, the kernels of `cuda/kernels/ops.py`."""

    name = "cuda"
    graphs = True
    host_is_device = False
    runs_ahead = True      # kernels run after their launch returns: the host can queue decode steps ahead
    dtype = np.dtype(np.float32)
    deltanet = None     # the Gated DeltaNet op (its f32 weights and decode buffers), made on first use

    def __init__(self, device_id: int = 0, bf16_tensor_cores: bool = True, fast_expert_gemm: str | None = None,
                 flash_prefill: bool = False, int8_activations: bool = False,
                 cublas_expert_gemm: bool | None = None, dense_gemm: str = "split") -> None:
        import cupy  # noqa: PLC0415 -- optional dependency, GPU machines only

        from colibri_format.runtime.cuda.kernels import ops  # noqa: PLC0415

        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= device_id < count:
            raise InvalidInput(f"device_id {device_id} does not exist ({count} CUDA devices)", field="device_id",
                               value=device_id)
        self.xp = cupy
        self.ops = ops
        self.device = cupy.cuda.Device(device_id)
        self.device.use()
        self.host_stream = None    # the engine's compute stream: device-to-host reads are ordered after it
        self.bf16_tensor_cores = bf16_tensor_cores
        self.fast_expert_gemm = fast_expert_gemm   # EngineConfig.fast_expert_gemm (None, auto, split, bf16, int8)
        self.cublas_expert_gemm = cublas_expert_gemm   # EngineConfig.cublas_expert_gemm (ops.uses_cublas_gemm)
        self.flash_prefill = flash_prefill      # prefill attention on attention_prefill.cu (tensor cores, bf16)
        self.int8_activations = int8_activations   # int4_group experts on int8 activations (ops.uses_a8)
        self.router_gemm_min_rows = ROUTER_GEMM_MIN_ROWS   # passes of this many rows route through cuBLAS (ops.router)
        self.dense_gemm = dense_gemm   # EngineConfig.dense_gemm: prefill-shaped bf16 products, x split or rounded
        # decode passes of this many rows (0: none) multiply bf16 matrices on dense_gemv_tc; read when the backend is
        # made, so a benchmark may set limits.DG_TC_MIN_ROWS before it opens an engine
        self.dense_tc_min_rows = limits.DG_TC_MIN_ROWS
        ops.warm_up()   # compile and load every kernel module now: loading cannot happen inside a capture

    # --- arrays -------------------------------------------------------------------------------------------
    def ptr(self, a) -> int:
        return int(a.data.ptr)

    def to_device(self, a: np.ndarray):
        return self.xp.asarray(np.ascontiguousarray(a))

    def to_host(self, a) -> np.ndarray:
        """A blocking copy ordered after the compute stream's work (the streams do not wait on the null one)."""
        return a.get(stream=self.host_stream or self.xp.cuda.get_current_stream())

    def synchronize(self) -> None:
        self.device.synchronize()

    def set_from_host(self, dst, src: np.ndarray, stream) -> None:
        """Copy a small host array into an existing device array on `stream` (None: the compute stream)."""
        dst.set(np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape), stream=stream or self.host_stream)

    def empty(self, shape, dtype=np.float32):
        return self.xp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype=np.float32):
        return self.xp.zeros(shape, dtype=dtype)

    def free_memory(self) -> int:
        return int(self.device.mem_info[0]) + int(self.xp.get_default_memory_pool().free_bytes())

    # --- products -------------------------------------------------------------------------------------------
    def gemm_bf16_split(self, x, w, out, hi=None, lo=None):
        """out [T, N] f32 = x [T, K] f32 @ w.T for w [N, K] bf16 bits (uint16), on the tensor cores.

        x is split into bf16 hi + lo (`ops.split_bf16`) and the two products are accumulated in fp32 by cuBLAS
        (`ops.gemm_bf16`): w is exact in bf16, x keeps ~16 mantissa bits, so the result matches the fp32 product to
        ~1e-5 relative. Capturable (`ops._gemm_ex`); hi and lo are allocated unless passed in.
        """
        T, K = x.shape
        if w.dtype != np.uint16 or w.ndim != 2 or w.shape[1] != K or out.shape != (T, w.shape[0]):
            raise ValueError(f"gemm_bf16_split: x {x.shape}, w {w.shape} {w.dtype}, out {out.shape} {out.dtype}")
        hi, lo = self.ops.split_bf16(x, hi=hi, lo=lo)
        self.ops.gemm_bf16(hi, w, out)
        return self.ops.gemm_bf16(lo, w, out, accumulate=True)

    # --- what the engine asks of a backend ---------------------------------------------------------------------
    def check_support(self, model: dict, blob_layout) -> None:
        """Refuse at open, naming the field, what the kernels cannot run."""
        check_cuda_support(model, blob_layout)

    def graph_blocker(self, args, batch: int) -> str | None:
        from colibri_format.runtime.cuda.dense import GEMV_MAX_ROWS  # noqa: PLC0415

        if args.head_dim not in ATTENTION_HEAD_DIMS and not args.mla:    # MLA runs mla.cu whatever its widths
            return f"head_dim {args.head_dim} uses the array-operation attention fallback"
        if batch > GEMV_MAX_ROWS:
            return (f"batch {batch} > {GEMV_MAX_ROWS} runs prefill-shaped passes (cuBLAS products, temporaries): "
                    f"decode graphs take up to {GEMV_MAX_ROWS} rows")
        return None

    def kernel_choices(self) -> tuple:
        """The switches the ops read per call (EngineConfig's, or set on the open backend by a benchmark): part of
        a kept graph's key, so that a graph captured under other choices is never replayed. bf16_tensor_cores is
        not one: the dense weights read it once, when they are loaded."""
        return (self.fast_expert_gemm, self.cublas_expert_gemm, self.flash_prefill, self.int8_activations,
                self.router_gemm_min_rows, self.dense_tc_min_rows, self.dense_gemm)

    def dense(self, reader):
        from colibri_format.runtime.cuda.dense import DeviceDense  # noqa: PLC0415

        return DeviceDense(reader, self)

    def expert_table(self, blob_ptrs, layout, check=None, route_totals=None, fill_ptrs=None):
        if layout.expert_format in PACKED_FORMATS:       # int4_group, mxfp4: the moe_gemv4.cu kernels
            return self.ops.PackedExpertTable.from_layout(blob_ptrs, layout, route_totals, fill_ptrs)
        return self.ops.ExpertTable.from_layout(blob_ptrs, layout, route_totals, fill_ptrs)

    def fills_on_read(self, rows: int, k: int, num_experts: int) -> bool:
        """Whether a pass of `rows` tokens runs the GEMV kernels, which fill admitted slots as they read."""
        return not self.ops.gemm_path(rows, k, num_experts)

    # --- the decoder's ops ------------------------------------------------------------------------------------
    def embedding(self, ids, table, *, mult: float, out):
        return self.ops.embedding(ids, table, mult=mult, out=out)

    def rmsnorm(self, x, w, eps: float, *, out):
        if not x.flags.c_contiguous:        # MLA's compressed kv: a column slice of kv_a_proj's output
            self.xp.copyto(out, x)
            x = out
        return self.ops.rmsnorm(x, w, eps, out=out)

    def add_rmsnorm(self, h, b, w, eps: float, *, alpha: float, out):
        return self.ops.add_rmsnorm(h, b, w, eps, alpha=alpha, out=out)

    def residual_add(self, a, b, *, alpha: float, out):
        return self.ops.residual_add(a, b, alpha=alpha, out=out)

    def silu_mul(self, gu, *, out):
        return self.ops.silu_mul(gu, out=out)

    def qkv_rope_kv(self, *args, **kwargs):
        return self.ops.qkv_rope_kv(*args, **kwargs)

    def gated_delta_net(self, *args, **kwargs):
        """A Gated DeltaNet layer (`runtime/cuda/deltanet.py`: a decode step is kernels on static buffers, capturable;
        a prefill is planned on the host and runs its spans chunked or recurrent)."""
        if self.deltanet is None:
            from colibri_format.runtime.cuda.deltanet import DeltaNet  # noqa: PLC0415

            self.deltanet = DeltaNet(self)
        return self.deltanet(*args, **kwargs)

    def attention(self, q, k_cache, v_cache, q_seq, q_len, scale: float, *, window: int, out, ws, max_len: int,
                  sinks=None, host_rows=None):
        """The split attention kernel (splits and partials planned once per shape), or, for head sizes it is not
        built for, the NumPy backend's array code on device arrays (eager only). sinks: f32 [heads] or None. With
        `flash_prefill`, passes of more than ATT_DECODE_MAX_ROWS rows run `ops.attention_prefill` over a tile plan
        made from `host_rows` (host copies of q_seq and q_len) once per pass and window, or else from a
        device-to-host copy of them."""
        T, nh, hd = q.shape
        if hd not in ATTENTION_HEAD_DIMS:
            from colibri_format.runtime.numpy_backend import attention  # noqa: PLC0415

            return attention(q, k_cache, v_cache, self.to_host(q_seq), self.to_host(q_len), scale, window=window,
                             sinks=sinks, out=out, xp=self.xp)
        if self.flash_prefill and self.ops.use_flash_prefill(q, k_cache):
            plan = self._flash_plan(host_rows, nh // k_cache.shape[2], window, k_cache, ws) if host_rows else None
            return self.ops.attention_prefill(q, k_cache, v_cache, q_seq, q_len, scale, window=window, sinks=sinks,
                                              out=out, plan=plan)
        nkv = k_cache.shape[2]
        key = ("attention", T, max_len)
        if key not in ws.extra:
            ns = self.ops.attention_splits(T, nkv, nh // nkv, max_len)
            ws.extra[key] = (ns, self.ops.AttentionWorkspace(T, nh, hd, ns) if ns > 1 else None)
        ns, aws = ws.extra[key]
        return self.ops.attention(q, k_cache, v_cache, q_seq, q_len, scale, window=window, sinks=sinks, out=out,
                                  nsplit=ns, workspace=aws)

    def _flash_plan(self, host_rows, group: int, window: int, k_cache, ws):
        """The flash prefill's tile plan for these rows: every layer of a pass shares its rows, so the plan is made
        (and copied to the device) once per pass and (group, window) instead of once per layer. Kept in the pass's
        workspace (ws.extra), not the backend: a prefill runner's graph reads its plan at every replay, and a plan
        the backend kept was replaced, and freed, by the next pass of other rows (the H200, session 25: a captured
        512-row prefill replayed after an eager 4096-row one read freed memory, an illegal address)."""
        seq_h, len_h = host_rows
        rows = (seq_h.tobytes(), len_h.tobytes(), k_cache.shape[:2])
        kept = ws.extra.get("flash_plans")
        if kept is None or kept[0] != rows:
            kept = ws.extra["flash_plans"] = (rows, {})
        plans = kept[1]
        if (group, window) not in plans:
            plans[group, window] = self.ops.prefill_attention_plan_on_device(seq_h, len_h, group, window, k_cache)
        return plans[group, window]

    def mla_attention(self, q, c, k_rope, k_b, v_b, cache, seq, pos, rpos, q_len, cos, sin, *, scale: float,
                      form: str, out, ws):
        """Multi-head latent attention on mla.cu, absorbed for decode steps and prefills alike (whatever `form`: the
        expanded form gives the same numbers up to rounding, tests/runtime/test_fidelity_mla.py); capturable."""
        T, nh, _ = q.shape
        key = ("mla", T, nh, c.shape[1], k_rope.shape[1])
        if key not in ws.extra:
            ws.extra[key] = self.ops.MlaWorkspace(*key[1:])
        return self.ops.mla_attention(q, c, k_rope, k_b, v_b, cache, seq, pos, rpos, q_len, cos, sin, scale=scale,
                                      out=out, workspace=ws.extra[key])

    def router(self, x, w, k: int, *, ws, out_ids, out_weights, **how):
        """The router (`ops.router`: through cuBLAS where `ops.router_by_gemm` says so for `router_gemm_min_rows`,
        else the fused kernel); `how`: bias, scoring, order, normalize, scale and groups of `ops.router`."""
        return self.ops.router(x, w, k, workspace=self._router_workspace(ws, x.shape[0], w.shape[0]),
                               out_ids=out_ids, out_weights=out_weights,
                               by_gemm=self.ops.router_by_gemm(x.shape[0], w.shape[0], self.router_gemm_min_rows),
                               **how)

    def add_rmsnorm_route(self, h, b, norm_w, eps: float, w, k: int, *, alpha: float, out, ws, out_ids,
                          out_weights, **how):
        """add_rmsnorm, then the router on its output: (out, ids, weights). One launch (`ops.add_rmsnorm_route`)
        for passes of up to NORM_ROUTE_MAX_ROWS rows whose norm weight has the router weight's dtype; the two ops
        otherwise."""
        if h.shape[0] > NORM_ROUTE_MAX_ROWS or self.ops.dtype_code(norm_w) != self.ops.dtype_code(w):
            self.add_rmsnorm(h, b, norm_w, eps, alpha=alpha, out=out)
            return (out, *self.router(out, w, k, ws=ws, out_ids=out_ids, out_weights=out_weights, **how))
        return self.ops.add_rmsnorm_route(h, b, norm_w, eps, w, k, alpha=alpha, out=out,
                                          workspace=self._router_workspace(ws, h.shape[0], w.shape[0]),
                                          out_ids=out_ids, out_weights=out_weights, **how)

    def _router_workspace(self, ws, rows: int, num_experts: int):
        key = ("router", rows, num_experts)
        if key not in ws.extra:
            ws.extra[key] = self.ops.RouterWorkspace(rows, num_experts)
        return ws.extra[key]

    def moe(self, x, ids, weights, table, *, residual, alpha: float, ws, act=None, gate_up_bias=None,
            down_bias=None):
        """Routed experts of one pass added to the residual (buffers from the workspace: capturable). act
        (model.expert_act), gate_up_bias [E, 2I] and down_bias [E, H] f32: gpt-oss's experts (`ops.ExpertExtras`)."""
        ops, (T, k) = self.ops, ids.shape
        P, E = T * k, table.num_experts
        if table.route_totals is not None:
            ops.count_routes(ids, table.route_totals)
        key = ("dispatch", P, E)
        if key not in ws.extra:
            ws.extra[key] = ops.dispatch_buffers(P, E)
        if isinstance(table, ops.PackedExpertTable):     # no expert extras with 4-bit experts (limits.py refuses)
            a8 = ops.uses_a8(self.int8_activations, table)
            return ops.moe_experts_4bit(x, ids, weights, table, residual=residual, alpha=alpha, disp=ws.extra[key],
                                        out=residual, act=ws.buf("moe_act", (P, table.intermediate_size)),
                                        ypair=ws.buf("moe_ypair", (P, table.hidden_size)), expansions=ws.extra,
                                        staged=(None, None) if a8 else self._tc4_staging(T, k, table, ws),
                                        int8_activations=a8, a8_buffers=self._a8_buffers(T, k, table, ws) if a8
                                        else None)
        extras = ops.ExpertExtras.from_model(act, gate_up_bias, down_bias)
        fast_gemm, cublas = self._expert_gemm(T, P, table, extras)
        return ops.moe_experts(x, ids, weights, table, residual=residual, alpha=alpha, disp=ws.extra[key],
                               out=residual,
                               act=ws.buf("moe_act", (P, table.intermediate_size)),
                               ypair=ws.buf("moe_ypair", (P, table.hidden_size)),
                               extras=extras, fast_gemm=fast_gemm, cublas=cublas,
                               staging=self._fast_staging(T, P, table, extras, ws, fast_gemm))

    def _expert_gemm(self, rows: int, pairs: int, table, extras) -> tuple:
        """(fast_gemm, cublas) for moe_experts on a pass of `rows` rows and `pairs` routed pairs; 'auto' becomes
        `ops.auto_activations`' choice. The cuBLAS routes synchronize with the host, so only passes of more than
        ATT_DECODE_MAX_ROWS rows take them: smaller ones may be captured in a decode graph (graph_blocker), where
        'int8' and 'auto' run the pipelined kernel's 'split' and cuBLAS is not asked."""
        fast_gemm = self.fast_expert_gemm
        if rows <= ATT_DECODE_MAX_ROWS:
            return ("split" if fast_gemm in ("int8", "auto") else fast_gemm), False
        if fast_gemm == "auto":
            fast_gemm = self.ops.auto_activations(pairs, table, extras)
        return fast_gemm, self.cublas_expert_gemm

    def _tc4_staging(self, T: int, k: int, table, ws) -> tuple:
        """The tensor-core 4-bit GEMVs' staged (x, act) buffers (workspace), for the decode passes they run."""
        ops, H, I = self.ops, table.hidden_size, table.intermediate_size
        if not ops.uses_tc4(None, table, T) or ops.gemm_path(T, k, table.num_experts):
            return None, None
        return (ws.buf("moe4_x_staged", (T, 2, H // 2), np.uint32),
                ws.buf("moe4_act_staged", (T * k, 2, I // 2), np.uint32))

    def _a8_buffers(self, T: int, k: int, table, ws) -> dict:
        """The int8-activation path's buffers (workspace): decode passes the int8 x and act with their group scales,
        prefill (GEMM) passes the rounded x (act is rounded in place)."""
        ops, H, I, P = self.ops, table.hidden_size, table.intermediate_size, T * k
        if ops.gemm_path(T, k, table.num_experts):
            return {"x_rounded": ws.buf("moe4a8_x_rounded", (T, H))}
        g = ops.A8_GROUP
        return {"xq": ws.buf("moe4a8_xq", (T, H), np.int8), "xs": ws.buf("moe4a8_xs", (T, H // g)),
                "aq": ws.buf("moe4a8_aq", (P, I), np.int8), "as": ws.buf("moe4a8_as", (P, I // g))}

    def _fast_staging(self, T: int, P: int, table, extras, ws, fast_gemm):
        """The pipelined expert GEMM's bf16 input copies (workspace buffers), when it may run."""
        if fast_gemm == "int8" or not self.ops.uses_fast_gemm(fast_gemm, table, extras):
            return None     # int8 (W8A8) runs on cuBLAS, which stages its own inputs
        H, I = table.hidden_size, table.intermediate_size
        key = ("fast_staging", T, P, H, I)
        if key not in ws.extra:
            ws.extra[key] = self.ops.fast_gemm_staging(T, P, H, I)
        return ws.extra[key]

    def count_routes(self, ids, totals):
        return self.ops.count_routes(ids, totals)

    # --- profiling --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def profiled(self, record):
        """Within the block every kernel wrapper call is bracketed by timing events on the compute stream and
        reported as record(name, start_event, end_event, args, kwargs) (the benchmark library's hook)."""
        real = self.ops
        self.ops = _TimedOps(real, self, record)
        try:
            yield
        finally:
            self.ops = real

    # --- streams, events ------------------------------------------------------------------------------------
    def new_stream(self):
        return self.xp.cuda.Stream(non_blocking=True)

    def record(self, stream):
        return stream.record()

    def release_stream(self, stream) -> None:
        """What `stream` holds beyond the engine's own buffers (its cuBLAS workspace, `cublas_direct`), freed once
        its work is done (Engine.close)."""
        with self.device:
            stream.synchronize()
            self.ops.cublas_direct.release(self.xp, stream.ptr)

    def timing_event(self, stream):
        ev = self.xp.cuda.Event()
        ev.record(stream)
        return ev

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return float(self.xp.cuda.get_elapsed_time(start, end))

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def sync_event(self, event) -> None:
        event.synchronize()

    def event_done(self, event) -> bool:
        return bool(event.done)

    # --- host memory ----------------------------------------------------------------------------------------
    def register_host(self, addr: int, nbytes: int) -> None:
        """Pin a read-only file mapping in place (raises on failure; the caller falls back to staging)."""
        self.xp.cuda.runtime.hostRegister(addr, nbytes, HOST_REGISTER_READ_ONLY)

    def unregister_host(self, addr: int) -> None:
        self.xp.cuda.runtime.hostUnregister(addr)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        mem = self.xp.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, np.uint8, nbytes)

    def copy_htod(self, dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
        self.xp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, MEMCPY_HOST_TO_DEVICE, stream.ptr)

    def copy_to_host_async(self, dst: np.ndarray, src, stream) -> None:
        """dst (pinned host memory) <- src, ordered on `stream`; read dst after an event recorded behind it."""
        self.xp.cuda.runtime.memcpyAsync(int(dst.ctypes.data), self.ptr(src), src.nbytes, MEMCPY_DEVICE_TO_HOST,
                                         stream.ptr)

    # --- graphs ---------------------------------------------------------------------------------------------
    def capture(self, stream, fn, memory=None):
        """Record fn()'s launches on `stream` into a graph; on any error the capture is ended and re-raised. Device
        memory fn allocates comes from `memory` (a `graph_memory()`, which the caller keeps as long as the graph:
        the graph's own, never handed to anyone else); without it an allocation raises, since the graph would keep
        writing memory that CuPy's pool hands out again once the array that held it is gone."""
        stream.begin_capture()
        try:
            with self.xp.cuda.using_allocator(_refuse_allocation if memory is None else memory.malloc):
                fn()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 -- the capture is already invalid; the first error matters
                pass
            raise
        return stream.end_capture()

    def graph_memory(self):
        """A memory pool of its own for one graph's temporaries (`capture(memory=)`)."""
        return self.xp.cuda.MemoryPool()

    def launch(self, graph, stream) -> None:
        graph.launch(stream)


def _refuse_allocation(nbytes: int):
    raise RuntimeError(f"a {nbytes}-byte device allocation inside a graph capture without memory of its own "
                       "(buffers must come from the workspace, made by the eager pass before the capture)")


class _TimedOps:
    """The kernel wrappers, each call bracketed by timing events (see CupyBackend.profiled)."""

    def __init__(self, ops, be, record) -> None:
        self._ops, self._be, self._record = ops, be, record

    def __getattr__(self, name: str):
        value = getattr(self._ops, name)
        if not callable(value) or isinstance(value, type):
            return value

        def timed(*args, **kwargs):
            start = self._be.timing_event(self._be.host_stream)
            result = value(*args, **kwargs)
            self._record(name, start, self._be.timing_event(self._be.host_stream), args, kwargs)
            return result
        return timed


def make_backend(device_id: int = 0, bf16_tensor_cores: bool = True, fast_expert_gemm: str | None = None,
                 flash_prefill: bool = False, int8_activations: bool = False,
                 cublas_expert_gemm: bool | None = None, dense_gemm: str = "split") -> CupyBackend:
    return CupyBackend(device_id, bf16_tensor_cores, fast_expert_gemm, flash_prefill, int8_activations,
                       cublas_expert_gemm, dense_gemm)

#!/usr/bin/env bash
# The CUDA engine's device run, in order, each step under its own time limit; logs and JSON go to $OUT.
# Run from the repository root (it exports PYTHONPATH=. for the benchmarks, which import the library only, and keeps
# CuPy's kernel cache in build/cupy_cache: carry that path into later device calls):
#   STEPS="tests sanitizer hf paging" bash benchmarks/gpu_suite.sh
# Steps:
#   tests        `pytest -m gpu tests`: every GPU test, the engine scenarios on device="cuda" included; ~300 s warm,
#                ~400 s on a fresh machine whose kernels all compile first
#   sanitizer    compute-sanitizer memcheck on benchmarks/sanitize_tiny.py
#   hf           benchmarks/gpu_vs_hf.py
#   paging       benchmarks/paging.py
#   gemm         benchmarks/wgmma_probe.py, then benchmarks/prefill_gemm.py on Mixtral's 512-token expert products
#   router       benchmarks/router_prefill.py: the fused router against its GEMM route at 16-4096 rows
#                (limits.ROUTER_GEMM_MIN_ROWS)
#   ncu          Nsight Compute over benchmarks/ncu_prefill_kernels.py: what limits the W8A8 expert GEMM and the
#                router at 512 rows of Qwen3, OLMoE and Mixtral (ncu.csv)
#   ncu_decode   Nsight Compute over one full-depth decode step, benchmarks/ncu_decode_step.py (ncu_decode.csv;
#                NCU_DECODE_ARGS picks another shape, batch or context)
#   prefill_host benchmarks/prefill_host.py on Qwen3 and OLMoE at 512 and 128 tokens with prefill graphs, float32
#                and bf16 KV caches, split and bf16 dense products (PREFILL_HOST_ARGS adds options, e.g. --router
#                gemm,fused; the router step times both routes' kernels)
#   sweep        benchmarks/prefill_gemm.py --sweep on Qwen3's and OLMoE's 512-row expert blocks: the W8A8 kernels'
#                pipeline depths, FAST_SKIP_EMPTY_M, FAST_STAGE_STEPS, FAST_L2_PREFETCH and FAST_PERSISTENT (each
#                kernel's weight GB/s from CUPTI; results written after every build)
#   dispatch     benchmarks/dispatch_spread.py: the one-block dispatch against the spread one at 128-4096 tokens
#                (limits.DISPATCH_SPREAD_MIN_PAIRS)
#   dense_tc     benchmarks/dense_gemv_sweep.py --tc (dense_gemv_tc against the dense_gemv passes, 1-32 rows, the
#                decode shapes), then decode_profile.py --dense-tc-ab --kv-bf16-ab on Qwen3 at batches 1, 8 and 32:
#                what sets limits.DG_TC_MIN_ROWS, and a bf16 KV cache's decode
#   kv_decode    benchmarks/decode_profile.py on Qwen3 at batches 1 and 8 after a 4096-token prompt (--context), with
#                the float32 and the bf16 KV cache: decode at depth, where the cache's bytes count
#   prefill      benchmarks/prefill_gemm.py on Mixtral's, Qwen3's and OLMoE's 512-row expert blocks (host-timed and
#                device-timed), then
#                benchmarks/prefill_engine.py: full-depth prefill, the defaults beside the split and W8A8 ('int8')
#                options and transformers bf16, and a CUPTI timeline of each default prefill (its largest kernels)
# HF_SHAPES / PAGING_ARGS / PREFILL_VARIANTS narrow the benchmarks. SAVE_CACHE=1 leaves CuPy's kernel cache as
# $OUT/cupy_cache.tgz (unpack it into build/ here and carry build/cupy_cache: the next call skips compiling).
# DRY=1 runs the sanitizer workload, hf and paging with --dry-run (device="cpu", no GPU; tests then skip).
set -o pipefail
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
# CuPy's compiled kernels under build/ (git-ignored): a device call that carries build/cupy_cache skips NVRTC
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/build/cupy_cache}
STEPS=${STEPS:-"tests sanitizer hf paging"}
T_TESTS=${T_TESTS:-420} T_SAN=${T_SAN:-120} T_HF=${T_HF:-240} T_PAGING=${T_PAGING:-180} T_GEMM=${T_GEMM:-240}
T_PREFILL=${T_PREFILL:-420} T_ROUTER=${T_ROUTER:-120} T_NCU=${T_NCU:-240} T_NCU_DECODE=${T_NCU_DECODE:-300}
T_PREFILL_HOST=${T_PREFILL_HOST:-300} T_SWEEP=${T_SWEEP:-360} T_DENSE_TC=${T_DENSE_TC:-420} T_DISPATCH=${T_DISPATCH:-90}
T_KV_DECODE=${T_KV_DECODE:-240}
PREFILL_VARIANTS=${PREFILL_VARIANTS:-"fast-split + flash,fast-int8 + flash,defaults"}
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader \
    > "$OUT/machine.txt" 2>&1
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/machine.txt"

for step in $STEPS; do
  t0=$SECONDS
  case $step in
    tests)
      timeout "$T_TESTS" python3 -m pytest -m gpu tests -v -p no:cacheprovider --maxfail=6 -rs --tb=short \
          > "$OUT/pytest_gpu.log" 2>&1
      rc=$?; summary+=("tests rc=$rc $(grep -cE " PASSED" "$OUT/pytest_gpu.log") passed, $(grep -cE " FAILED| ERROR" "$OUT/pytest_gpu.log") failed; $(tail -1 "$OUT/pytest_gpu.log") ($((SECONDS - t0)) s)") ;;
    sanitizer)
      if [ -n "${DRY:-}" ]; then
        timeout "$T_SAN" python3 benchmarks/sanitize_tiny.py --dry-run > "$OUT/sanitizer.log" 2>&1
      else
        SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
        timeout "$T_SAN" "$SAN" --tool memcheck --print-limit 20 python3 benchmarks/sanitize_tiny.py \
            > "$OUT/sanitizer.log" 2>&1
      fi
      rc=$?; summary+=("sanitizer rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1) ($((SECONDS - t0)) s)") ;;
    hf)
      timeout "$T_HF" python3 benchmarks/gpu_vs_hf.py --out "$OUT/gpu_vs_hf.json" --shapes "${HF_SHAPES:-olmoe,qwen3,mixtral}" \
          ${DRY:+--dry-run} > "$OUT/gpu_vs_hf.log" 2>&1
      rc=$?; summary+=("gpu_vs_hf rc=$rc ($((SECONDS - t0)) s)") ;;
    paging)
      timeout "$T_PAGING" python3 benchmarks/paging.py --out "$OUT/paging.json" ${PAGING_ARGS:-} ${DRY:+--dry-run} \
          > "$OUT/paging.log" 2>&1
      rc=$?; summary+=("paging rc=$rc ($((SECONDS - t0)) s)") ;;
    gemm)
      if [ -n "${DRY:-}" ]; then
        timeout "$T_GEMM" python3 benchmarks/wgmma_probe.py --compile-only > "$OUT/gemm.log" 2>&1
      else
        # both run whatever the other does (a probe kernel that faults must not hide the engine's figures)
        timeout "$T_GEMM" bash -c "python3 benchmarks/wgmma_probe.py --out '$OUT/wgmma'; a=\$?; python3 \
            benchmarks/prefill_gemm.py --out '$OUT/prefill_gemm' --cases mixtral-512; exit \$((a || \$?))" \
            > "$OUT/gemm.log" 2>&1
      fi
      rc=$?; summary+=("gemm rc=$rc ($((SECONDS - t0)) s)") ;;
    router)
      if [ -n "${DRY:-}" ]; then summary+=("router skipped: it times CUDA kernels"); continue; fi
      timeout "$T_ROUTER" python3 benchmarks/router_prefill.py --out "$OUT/router" > "$OUT/router.log" 2>&1
      rc=$?; summary+=("router rc=$rc ($((SECONDS - t0)) s)") ;;
    ncu)
      if [ -n "${DRY:-}" ]; then summary+=("ncu skipped: it profiles CUDA kernels"); continue; fi
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      timeout "$T_NCU" "$NCU" --clock-control none --kernel-name "regex:moe_gemm_fast|moe_router|router_widen|gemm" \
          --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
          --csv --page details python3 benchmarks/ncu_prefill_kernels.py > "$OUT/ncu.csv" 2> "$OUT/ncu.log"
      rc=$?; summary+=("ncu rc=$rc $(grep -c '"' "$OUT/ncu.csv") csv lines ($((SECONDS - t0)) s)") ;;
    ncu_decode)
      if [ -n "${DRY:-}" ]; then
        timeout "$T_NCU_DECODE" python3 benchmarks/ncu_decode_step.py --tiny --dir /tmp > "$OUT/ncu_decode.log" 2>&1
        rc=$?; summary+=("ncu_decode (--tiny, CPU) rc=$rc"); continue
      fi
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      timeout "$T_NCU_DECODE" "$NCU" --clock-control none --nvtx --nvtx-include "ncu_step/" --section SpeedOfLight \
          --section Occupancy --section WarpStateStats --section LaunchStats --csv --page details \
          python3 benchmarks/ncu_decode_step.py ${NCU_DECODE_ARGS:-} > "$OUT/ncu_decode.csv" 2> "$OUT/ncu_decode.log"
      rc=$?; summary+=("ncu_decode rc=$rc $(grep -c '"' "$OUT/ncu_decode.csv") csv lines ($((SECONDS - t0)) s)") ;;
    prefill_host)
      if [ -n "${DRY:-}" ]; then summary+=("prefill_host skipped: it times the CUDA engine"); continue; fi
      timeout "$T_PREFILL_HOST" python3 benchmarks/prefill_host.py --out "$OUT/prefill_host" --shapes qwen3,olmoe \
          --tokens 512,128 --no-profile --graphs on --router gemm --kv-cache-dtype auto,bfloat16 --dense-gemm split,bf16 \
          ${PREFILL_HOST_ARGS:-} \
          > "$OUT/prefill_host.log" 2>&1
      rc=$?; summary+=("prefill_host rc=$rc ($((SECONDS - t0)) s)") ;;
    sweep)
      if [ -n "${DRY:-}" ]; then summary+=("sweep skipped: it times CUDA kernels"); continue; fi
      timeout "$T_SWEEP" python3 benchmarks/prefill_gemm.py --out "$OUT/sweep" --cases \
          --sweep qwen3-30b-a3b-512 olmoe-512 > "$OUT/sweep.log" 2>&1
      rc=$?; summary+=("sweep rc=$rc ($((SECONDS - t0)) s)") ;;
    dispatch)
      if [ -n "${DRY:-}" ]; then summary+=("dispatch skipped: it times CUDA kernels"); continue; fi
      timeout "$T_DISPATCH" python3 benchmarks/dispatch_spread.py --out "$OUT/dispatch" > "$OUT/dispatch.log" 2>&1
      rc=$?; summary+=("dispatch rc=$rc ($((SECONDS - t0)) s)") ;;
    dense_tc)
      if [ -n "${DRY:-}" ]; then summary+=("dense_tc skipped: it times CUDA kernels"); continue; fi
      timeout "$T_DENSE_TC" bash -c "python3 benchmarks/dense_gemv_sweep.py --tc --out '$OUT/dense_tc'; a=\$?; \
          python3 benchmarks/decode_profile.py --out '$OUT/dense_tc' --skip-gemv --shapes qwen3 --batches 1,8,32 \
          --dense-tc-ab --kv-bf16-ab; exit \$((a || \$?))" > "$OUT/dense_tc.log" 2>&1
      rc=$?; summary+=("dense_tc rc=$rc ($((SECONDS - t0)) s)") ;;
    kv_decode)
      if [ -n "${DRY:-}" ]; then summary+=("kv_decode skipped: it times the CUDA engine"); continue; fi
      timeout "$T_KV_DECODE" python3 benchmarks/decode_profile.py --out "$OUT/kv_decode" --skip-gemv --shapes qwen3 \
          --batches 1,8 --context 4096 --kv-bf16-ab > "$OUT/kv_decode.log" 2>&1
      rc=$?; summary+=("kv_decode rc=$rc ($((SECONDS - t0)) s)") ;;
    prefill)
      if [ -n "${DRY:-}" ]; then
        timeout "$T_PREFILL" python3 benchmarks/prefill_engine.py --out "$OUT/prefill_engine" --tiny --device cpu \
            --no-peer --no-decode --tokens 40 > "$OUT/prefill.log" 2>&1
      else
        timeout "$T_PREFILL" bash -c "python3 benchmarks/prefill_gemm.py --out '$OUT/prefill_gemm' --cases mixtral-512 \
            qwen3-30b-a3b-512 olmoe-512; a=\$?; python3 benchmarks/prefill_engine.py --out \
            '$OUT/prefill_engine' --shapes mixtral,qwen3,olmoe --tokens 512,4096 --no-decode --timeline \
            --variants '$PREFILL_VARIANTS'; \
            exit \$((a || \$?))" > "$OUT/prefill.log" 2>&1
      fi
      rc=$?; summary+=("prefill rc=$rc ($((SECONDS - t0)) s)") ;;
  esac
done

echo "==== pytest -m gpu (failures, then the tail)"; grep -E " FAILED| ERROR" "$OUT/pytest_gpu.log" 2>/dev/null | head -20
tail -8 "$OUT/pytest_gpu.log" 2>/dev/null
echo "==== sanitizer (tail)"; tail -6 "$OUT/sanitizer.log" 2>/dev/null
echo "==== gpu_vs_hf"; grep -E "^\||FAILED|Error" "$OUT/gpu_vs_hf.log" 2>/dev/null | tail -12
echo "==== paging"; grep -E "^\||FAILED|Error|Traceback" "$OUT/paging.log" 2>/dev/null | tail -40
echo "==== gemm"; grep -E "TFLOP|error|Error|built|\|" "$OUT/gemm.log" 2>/dev/null | tail -40
echo "==== router"; grep -E "^\||Error|Traceback" "$OUT/router.log" 2>/dev/null | tail -45
echo "==== ncu"; grep -E "Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|ncu_prefill_kernels\]" \
    "$OUT/ncu.csv" 2>/dev/null | cut -c1-220 | head -60
echo "==== ncu_decode"; grep -E "Duration|DRAM Throughput|ncu_decode_step\]" "$OUT/ncu_decode.csv" 2>/dev/null \
    | cut -c1-200 | head -40
echo "==== prefill_host"; grep -E "tokens: first two|fast_expert_gemm|Error|Traceback" "$OUT/prefill_host.log" \
    2>/dev/null | cut -c1-240 | tail -20
echo "==== dense_tc"; grep -E "^\||WRONG|decode batch|again with|Error|Traceback" "$OUT/dense_tc.log" 2>/dev/null | tail -60
echo "==== kv_decode"; grep -E "decode batch|again with|Error|Traceback" "$OUT/kv_decode.log" 2>/dev/null | tail -20
echo "==== dispatch"; grep -E "^\||Error|Traceback" "$OUT/dispatch.log" 2>/dev/null | tail -16
echo "==== sweep"; grep -E "== |-kernel|Error|Traceback" "$OUT/sweep.log" 2>/dev/null | cut -c1-120 | tail -70
echo "==== prefill"; grep -E "block|products|int8|prefill [0-9]|transformers|Error|Traceback|^  " "$OUT/prefill.log" 2>/dev/null \
    | tail -140
if [ -n "${SAVE_CACHE:-}" ] && [ -d "$CUPY_CACHE_DIR" ]; then
  tar czf "$OUT/cupy_cache.tgz" -C "$(dirname "$CUPY_CACHE_DIR")" "$(basename "$CUPY_CACHE_DIR")"
  summary+=("kernel cache saved: $OUT/cupy_cache.tgz ($(du -h "$OUT/cupy_cache.tgz" | cut -f1))")
fi
echo "==== summary"; printf '%s\n' "${summary[@]}"

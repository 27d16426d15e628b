#!/usr/bin/env bash
# The CUDA engine's device run, in order, each step under its own time limit; logs and JSON go to $OUT.
#   STEPS="tests sanitizer hf paging" bash benchmarks/gpu_suite.sh
# Steps: tests (tests/runtime/cuda/test_gpu_cuda_engine.py), sanitizer (compute-sanitizer memcheck on a tiny model),
# hf (benchmarks/gpu_vs_hf.py), paging (benchmarks/paging.py). HF_SHAPES / PAGING_ARGS narrow the benchmarks.
set -o pipefail
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
STEPS=${STEPS:-"tests sanitizer hf paging"}
T_TESTS=${T_TESTS:-150} T_SAN=${T_SAN:-120} T_HF=${T_HF:-240} T_PAGING=${T_PAGING:-180}
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader \
    > "$OUT/machine.txt" 2>&1
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/machine.txt"

for step in $STEPS; do
  t0=$SECONDS
  case $step in
    tests)
      timeout "$T_TESTS" python3 -m pytest tests/runtime/cuda/test_gpu_cuda_engine.py -q -p no:cacheprovider --maxfail=6 -rs --tb=short \
          > "$OUT/tests.log" 2>&1
      rc=$?; summary+=("tests rc=$rc $(tail -1 "$OUT/tests.log") ($((SECONDS - t0)) s)") ;;
    sanitizer)
      SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
      timeout "$T_SAN" "$SAN" --tool memcheck --print-limit 20 python3 benchmarks/sanitize_tiny.py \
          > "$OUT/sanitizer.log" 2>&1
      rc=$?; summary+=("sanitizer rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1) ($((SECONDS - t0)) s)") ;;
    hf)
      timeout "$T_HF" python3 benchmarks/gpu_vs_hf.py --out "$OUT/gpu_vs_hf.json" --shapes "${HF_SHAPES:-olmoe,qwen3,mixtral}" \
          > "$OUT/gpu_vs_hf.log" 2>&1
      rc=$?; summary+=("gpu_vs_hf rc=$rc ($((SECONDS - t0)) s)") ;;
    paging)
      timeout "$T_PAGING" python3 benchmarks/paging.py --out "$OUT/paging.json" ${PAGING_ARGS:-} \
          > "$OUT/paging.log" 2>&1
      rc=$?; summary+=("paging rc=$rc ($((SECONDS - t0)) s)") ;;
  esac
done

echo "==== tests (tail)"; tail -25 "$OUT/tests.log" 2>/dev/null
echo "==== sanitizer (tail)"; tail -6 "$OUT/sanitizer.log" 2>/dev/null
echo "==== gpu_vs_hf"; grep -E "^\||FAILED|Error" "$OUT/gpu_vs_hf.log" 2>/dev/null | tail -12
echo "==== paging"; grep -E "^\||FAILED|Error|Traceback" "$OUT/paging.log" 2>/dev/null | tail -40
echo "==== summary"; printf '%s\n' "${summary[@]}"

#!/usr/bin/env bash
# Which earlier GPU test file makes a later GPU test fail (an order-dependent failure: the target passes alone).
# For each file holding GPU tests (every tests/**/test_*.py with a `gpu` mark, in pytest's order), runs that file's
# GPU tests and then the target in one process, and prints the pair's outcome. GPU machine only; ~10-20 s a pair.
#   TARGET="tests/runtime/test_engine_scenarios.py::test_long_prefill[cuda]" bash benchmarks/gpu_order_bisect.sh
# Seen 2026-12-01 (docs/benchmarks.md, "Whole GPU suite, 2026-12-01 evening"): test_long_prefill[cuda] fails after
# the whole suite, passes alone and after its own module.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
TARGET=${TARGET:-"tests/runtime/test_engine_scenarios.py::test_long_prefill[cuda]"}
T_PAIR=${T_PAIR:-90}
target_file=${TARGET%%::*}
files=$(python3 -m pytest -m gpu tests -q -p no:cacheprovider --collect-only 2>/dev/null \
        | grep '::' | sed 's/::.*//' | awk '!seen[$0]++')
echo "target alone: $(timeout "$T_PAIR" python3 -m pytest -q -p no:cacheprovider "$TARGET" 2>&1 | tail -1)"
for f in $files; do
  [ "$f" = "$target_file" ] && break        # files after the target's cannot have run before it
  out=$(timeout "$T_PAIR" python3 -m pytest -m gpu -q -p no:cacheprovider "$f" "$TARGET" \
        --tb=no 2>&1 | tail -1)
  echo "$f then target: $out"
done

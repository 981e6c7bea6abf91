#!/usr/bin/env bash
# One device call: GPU correctness (the test suite compiled for real, not
# interpreted) and the benchmark suite. Results land under $OUT; at most 8
# files come back, so the suite writes no plots there: render them here with
#   python -m benchmarks.report <files_at>/bench/results.json --results_md benchmarks/RESULTS.md --plots_dir benchmarks/plots
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pallaskit-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
JAX_PLATFORMS=cuda PALLASKIT_INTERPRET=0 timeout "${TEST_TIMEOUT:-240}" \
  python3 -m pytest ${TESTS:-tests/test_fusion.py tests/test_api.py} -q -p no:cacheprovider -W ignore 2>&1 \
  | grep -v -i deprecat > "$OUT/gpu_tests.log"
tail -15 "$OUT/gpu_tests.log"
python3 -m benchmarks.run --output "$OUT/bench" --noplots --results_md=none --noprogress \
  --time_budget_s "${BENCH_BUDGET_S:-420}" ${BENCH_ARGS:-} 2>&1 | grep -v -i deprecat > "$OUT/bench.log"
tail -40 "$OUT/bench.log"

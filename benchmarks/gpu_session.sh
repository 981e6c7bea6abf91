#!/usr/bin/env bash
# One device call: GPU correctness (the test suite compiled for real, not
# interpreted) and the benchmark run. Results land under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pallaskit-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
JAX_PLATFORMS=cuda PALLASKIT_INTERPRET=0 timeout "${TEST_TIMEOUT:-240}" \
  python3 -m pytest ${TESTS:-tests/test_fusion.py tests/test_api.py} -q -p no:cacheprovider -W ignore 2>&1 \
  | grep -v -i deprecat > "$OUT/gpu_tests.log"
tail -15 "$OUT/gpu_tests.log"
python3 -m benchmarks.run --output "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | grep -v -i deprecat > "$OUT/bench.log"
tail -40 "$OUT/bench.log"

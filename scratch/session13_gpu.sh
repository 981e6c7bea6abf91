#!/bin/bash
# Session 13's device batch: raw Triton mix kernels inside the XLA program. Usage: bash scratch/session13_gpu.sh PART
unset PYTHONDONTWRITEBYTECODE
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
python3 -m pip install -q --no-deps scratch/wheels/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SUITE="python3 -m benchmarks.run --dtypes=bfloat16 --sizes=full --noplots --results_md=none --noprogress"
summarize() {  # dots of a quiet pytest log, counted
  grep -E "^[.sxFE]+ *\[" $1 | tr -d ' ' | cut -d[ -f1 | tr -d '\n' | fold -w1 | sort | uniq -c
  grep -E "^FAILED|^ERROR" $1 | cut -c1-300 | head -30
}
case "$1" in
norms)
  JAX_PLATFORMS=cuda PALLASKIT_INTERPRET=0 timeout 200 python3 -m pytest -q tests/test_mix_order.py -rf -x \
    > $OUT/mix_tests.log 2>&1; echo "mix tests rc $?"; summarize $OUT/mix_tests.log
  timeout 300 $SUITE --workloads=rmsnorm_bwd,layernorm_fwd_bwd,first_call_rmsnorm_bwd --backends=pallaskit,pallaskit_pallas_mix,xla,torch_compile \
    --repeats=15 --output $OUT/norms --time_budget_s=240 > $OUT/norms.log 2>&1; echo "norms rc $?"
  grep -E "^\| (rmsnorm_bwd|layernorm_fwd_bwd)" -r $OUT/norms | head ;;
tests)
  export JAX_PLATFORMS=cuda PALLASKIT_INTERPRET=0
  timeout 540 python3 -m pytest -q tests/test_mix_order.py tests/test_autodiff.py tests/test_cache.py tests/test_fusion.py tests/test_api.py \
    -rf > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; summarize $OUT/gpu_tests.log ;;
esac

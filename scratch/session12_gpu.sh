#!/bin/bash
# Session 12's device batch: command buffers. Usage on the device: bash scratch/session12_gpu.sh PART
unset PYTHONDONTWRITEBYTECODE
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
python3 -m pip install -q --no-deps scratch/wheels/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SUITE="python3 -m benchmarks.run --dtypes=bfloat16 --sizes=full --noplots --results_md=none --noprogress"
case "$1" in
sweep)
  python3 scratch/profile_cold_eager.py --parallel --noprofile > /dev/null 2>&1  # warm bytecode (untimed)
  JAX_PLATFORMS=cuda PALLASKIT_INTERPRET=0 timeout 150 python3 -m pytest -q tests/test_cache.py -k "command_buffer or cuda_graph" -rf \
    > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
  for i in 1 2; do
    timeout 200 $SUITE --workloads=dynamic_mlp_sweep --backends=pallaskit_dynamic,xla --output $OUT/sweep$i \
      --time_budget_s=150 > $OUT/sweep$i.log 2>&1; echo "sweep$i rc $?"
  done ;;
steady)
  JAX_PLATFORMS=cuda PALLASKIT_INTERPRET=0 timeout 150 python3 -m pytest -q tests/test_cache.py -k "command_buffer or cuda_graph" -rf \
    > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
  timeout 150 $SUITE --workloads=matmul_hint_runtime --backends=pallaskit --repeats=15 --output $OUT/hint \
    --time_budget_s=120 > $OUT/hint.log 2>&1; echo "hint rc $?"
  timeout 260 $SUITE --workloads=gelu_mlp,rmsnorm_bwd,layernorm_fwd_bwd,train_step,softmax --backends=pallaskit,xla \
    --output $OUT/steady_on --time_budget_s=200 > $OUT/steady_on.log 2>&1; echo "on rc $?"
  PALLASKIT_COMMAND_BUFFERS=false timeout 200 $SUITE --workloads=gelu_mlp,rmsnorm_bwd,layernorm_fwd_bwd,train_step,softmax \
    --backends=pallaskit --output $OUT/steady_off --time_budget_s=150 > $OUT/steady_off.log 2>&1; echo "off rc $?" ;;
check)
  JAX_PLATFORMS=cuda PALLASKIT_INTERPRET=0 timeout 240 python3 -m pytest -q tests/test_cache.py tests/test_dynamic.py \
    tests/test_multikernel.py tests/test_api.py -rf > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
  timeout 150 $SUITE --workloads=matmul_hint_runtime --backends=pallaskit --repeats=15 --output $OUT/hint \
    --time_budget_s=120 > $OUT/hint.log 2>&1; echo "hint rc $?"
  python3 scratch/profile_cold_eager.py --parallel --noprofile > /dev/null 2>&1  # warm bytecode (untimed)
  timeout 280 $SUITE --workloads=dynamic_mlp_sweep --backends=pallaskit_dynamic,xla,torch_compile_dynamic \
    --output $OUT/sweep3 --time_budget_s=200 > $OUT/sweep3.log 2>&1; echo "sweep3 rc $?" ;;
cache)
  D=$(mktemp -d); E=$(mktemp -d)
  for M in 431 1035 1857; do
    python3 scratch/probe_cmdbuf_cache.py $D compile $M; python3 scratch/probe_cmdbuf_cache.py $D hit $M
    PALLASKIT_COMMAND_BUFFERS=false python3 scratch/probe_cmdbuf_cache.py $E off $M
  done 2>&1 | grep -v Warn | tee $OUT/cache.txt ;;
more)
  export JAX_PLATFORMS=cuda PALLASKIT_INTERPRET=0
  timeout 380 python3 -m pytest -q tests/test_matmul.py tests/test_autodiff.py tests/test_mix_order.py \
    tests/test_fusion.py -rf > $OUT/gpu_on.log 2>&1; echo "on rc $?"
  grep -E "^[.sxFE]+ *\[" $OUT/gpu_on.log | tr -d ' ' | cut -d[ -f1 | tr -d '\n' | fold -w1 | sort | uniq -c
  grep -E "^FAILED|^ERROR" $OUT/gpu_on.log | cut -c1-200 | head -30
  if grep -q "^FAILED" $OUT/gpu_on.log; then
    PALLASKIT_COMMAND_BUFFERS=false timeout 120 python3 -m pytest -q --lf -rf > $OUT/gpu_off.log 2>&1
    echo "off:"; grep -E "^FAILED" $OUT/gpu_off.log | cut -c1-200 | head -30
  fi ;;
esac

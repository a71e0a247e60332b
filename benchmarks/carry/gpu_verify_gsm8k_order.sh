#!/usr/bin/env bash
# Next H200 call (issue 15 goal 4, written 2026-12-03 after that session's device time ran out):
# 1. the GPU tests added after the session's last GPU run (a level-2 sleep in
#    test_compiled_prefill_gpu.py; test_native_engine_gpu.py asserting the prefill ran
#    compiled) and test_fused_projections_gpu.py, whose run the time limit cut (T_TESTS);
# 2. the GSM8K recipe that measured ZoRRo+FCA at 0.93x naive+paged with the ZoRRo arm first:
#    both orders, more steps, and per step which layout the trainer ran (zorro_micro_batches:
#    ZoRRo's "auto" runs packed naive below ZORRO_MIN_WORK, right at GSM8K's ~16k naive tokens)
#    (T_RECIPE each; STEPS).
# Carry .whl (../shared/gpu/carry-wheels.sh):  bash benchmarks/carry/gpu_verify_gsm8k_order.sh
WHL=1 source benchmarks/carry/gpu_setup.sh
mkdir -p $OUT/first_zorro $OUT/first_naive
[ "${T_TESTS:-240}" -gt 0 ] && timeout ${T_TESTS:-240} python3 -m pytest -v -m gpu -p no:cacheprovider \
  tests/engines/sample/test_compiled_prefill_gpu.py tests/engines/sample/test_fused_projections_gpu.py \
  tests/engines/sample/test_native_engine_gpu.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -12
for order in zorro,naive naive,zorro; do
  dir=$OUT/first_${order%%,*}
  timeout ${T_RECIPE:-160} python3 benchmarks/bench_recipe.py --task gsm8k --steps ${STEPS:-10} --arms $order \
    --budget-s $(( ${T_RECIPE:-160} - 10 )) --out $dir 2>&1 | grep -v Warning | grep -E "^\||speedup|skipping|rror:" | tail -6
done
ls $OUT/*

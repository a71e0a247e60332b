#!/usr/bin/env bash
# One H200 call (issue 15 goal 4, 2026-12-03): the prefill's layers as compiled regions
# (SamplerConfig.compile_prefill). GPU tests of it (T_TESTS), then bench_prefill.py (eager vs
# compiled prefill, one process; T_BENCH), then the long-context QA recipe with compiled layers
# in both arms, whose samplers now compile their prefill by default (T_RECIPE, STEPS, ARMS).
# Carry .whl (../shared/gpu/carry-wheels.sh):
#   bash benchmarks/carry/gpu_compiled_prefill.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
 && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
[ "${T_TESTS:-110}" -gt 0 ] && timeout ${T_TESTS:-110} python3 -m pytest -v -m gpu -p no:cacheprovider \
  ${TESTS:-tests/engines/sample/test_compiled_prefill_gpu.py} 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -12
[ "${T_BENCH:-140}" -gt 0 ] && timeout ${T_BENCH:-140} python3 benchmarks/bench_prefill.py --out $OUT ${BENCH_ARGS:-} 2>&1 \
  | grep -v -i warn | tail -9
[ "${T_RECIPE:-300}" -gt 0 ] && timeout ${T_RECIPE:-300} python3 benchmarks/bench_recipe.py --task ${TASK:-longqa} \
  --steps ${STEPS:-4} --arms ${ARMS:-zorro+compiled,naive+compiled} --budget-s $(( ${T_RECIPE:-300} - 15 )) \
  --out $OUT/recipe ${RECIPE_ARGS:-} 2>&1 | grep -v Warning | grep -E "^\||speedup|skipping|Error|rror:" | tail -14
ls $OUT $OUT/recipe 2>/dev/null

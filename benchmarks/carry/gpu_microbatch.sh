#!/usr/bin/env bash
# Issue 15 goal 4 (long-context QA >= 4x, 2026-12-03). Stages, each skipped with its T_* = 0:
# GPU tests (T_TESTS, TESTS); profile_zorro_step.py --scan at the recipe's ZoRRo micro-batch
# shape with 1, 2 and 4 groups, eager and compiled (T_SCAN); probe_fresh_compiled.py: that
# micro-batch repeated against new lengths every step, bare eager / compiled and through the
# training engine with the recipe's settings (T_FRESH); the long-context QA recipe, both arms
# compiled (T_RECIPE, default off; RECIPE_ARGS e.g. --set client.train.micro_batch_tokens=32768).
# Carry .whl (../shared/gpu/carry-wheels.sh):  T_TESTS=0 T_SCAN=0 bash benchmarks/carry/gpu_microbatch.sh
WHL=1 source benchmarks/carry/gpu_setup.sh
[ "${T_TESTS:-170}" -gt 0 ] && timeout ${T_TESTS:-170} python3 -m pytest -v -m gpu -p no:cacheprovider \
  ${TESTS:-tests/engines/sample/test_native_engine_gpu.py} 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -12
[ "${T_SCAN:-200}" -gt 0 ] && (cd benchmarks && timeout ${T_SCAN:-200} python3 profile_zorro_step.py \
  --scan ${SCAN:-6400/128/8x1,6400/128/8x2,6400/128/8x4} --arms ${SCAN_ARMS:-split} --compiled \
  --rounds ${ROUNDS:-5} --out $OUT 2>&1 | grep -E "^\{|rror" | tail -8)
[ "${T_FRESH:-240}" -gt 0 ] && (cd benchmarks && timeout ${T_FRESH:-240} python3 probe_fresh_compiled.py \
  --fresh ${FRESH:-6} --out $OUT 2>&1 | grep -E "^\{|rror" | tail -5)
[ "${T_RECIPE:-0}" -gt 0 ] && timeout ${T_RECIPE} python3 benchmarks/bench_recipe.py --task ${TASK:-longqa} \
  --steps ${STEPS:-4} --arms ${ARMS:-zorro+compiled,naive+compiled} --budget-s $(( ${T_RECIPE} - 15 )) \
  --out $OUT/recipe ${RECIPE_ARGS:-} 2>&1 | grep -v Warning | grep -E "^\||speedup|skipping|Error|rror:" | tail -14
ls $OUT $OUT/recipe 2>/dev/null

#!/usr/bin/env bash
# Written 2026-12-07 (night session) for one device call (carry .whl):
# - T_TEST: the GPU tests of what changed or was never run since the last device call (the
#   rewritten bf16 greedy test, the compiled layers, the training update against a plain-torch
#   reference, async scheduling under preemption with the window the cache holds, min_tokens (its ban
#   now drops out-of-vocabulary stop ids), the sync tests); TESTS overrides the list;
# - T_SYNC: bench_sync.py --skip-step --profile (issue 15 goal 6: where a sync's time goes);
# - T_FCA: bench_fca.py on 8x16 P4096 S512 with the sweep (issue 15 goal 8, on the card it got);
# - T_ZORRO: bench_zorro.py at P4096/R512/G8 x4 groups, 7 iterations (goal 8's ZoRRo 3.8x);
# - T_GSM8K: bench_recipe.py GSM8K with the trainer resident, eager and compiled arms in one
#   process (goal 4; the compiled layers' gain in the recipe was never measured in one process).
WHL=1 source benchmarks/carry/gpu_setup.sh
PYT="python3 -m pytest -m gpu -p no:cacheprovider -v -rfE --continue-on-collection-errors"
TESTS=${TESTS:-"tests/engines/sample/test_native_engine_gpu.py tests/core/test_compiled_layers_gpu.py
  tests/engines/test_train_reference.py tests/engines/sample/test_async_scheduling_gpu.py
  tests/engines/sample/test_min_tokens.py tests/sync/test_sync_gpu.py"}
[ "${T_TEST:-0}" -gt 0 ] && timeout ${T_TEST} $PYT $TESTS -k "not compiled_decode_equals_eager" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | cut -c1-300 | tail -90
[ "${T_SYNC:-0}" -gt 0 ] && timeout ${T_SYNC} python3 benchmarks/bench_sync.py --skip-step \
  --iters ${SYNC_ITERS:-5} --receive-iters 10 --profile --out $OUT/sync 2>&1 \
  | grep -v -i warn | cut -c1-400 | tail -40
[ "${T_FCA:-0}" -gt 0 ] && timeout ${T_FCA} python3 benchmarks/bench_fca.py --shapes 0 \
  --no-sdpa --out $OUT/fca 2>&1 | grep -v -i warn | cut -c1-2500 | tail -30
[ "${T_ZORRO:-0}" -gt 0 ] && timeout ${T_ZORRO} python3 benchmarks/bench_zorro.py --groups 4 \
  --iters 7 --shapes 4096/512/8 --arms naive,split --out $OUT/zorro 2>&1 | grep -v -i warn | tail -12
[ "${T_GSM8K:-0}" -gt 0 ] && timeout ${T_GSM8K} python3 benchmarks/bench_recipe.py --task gsm8k \
  --steps 8 --keep-trainer --arms zorro,naive,zorro+compiled,naive+compiled \
  --budget-s $((T_GSM8K - 30)) --out $OUT/gsm8k 2>&1 | grep -v -i warn | tail -20
ls -R $OUT | head -20

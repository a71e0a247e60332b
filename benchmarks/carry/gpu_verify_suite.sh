#!/usr/bin/env bash
# Written 2026-12-07 (morning session): the GPU tests that the night session's 470 s limit cut
# (`pytest -m gpu tests/engines tests/adapters`), split so that each stage reports on its own,
# plus the bf16-rule probe of the one flaky case (gemma3 packed naive). Stages, each skipped
# with its T_* = 0; pytest streams one line per test (-v, -rA) so a cut stage still reports:
# - T_PROBE: benchmarks/probe_bf16_margins.py (every family x path, REPEATS runs);
# - T_SAMPLE: tests/engines/sample (without the three-compile compiled-vs-eager test);
# - T_ENG: tests/engines/*.py (not sample/), tests/client/test_handover_gpu.py, tests/adapters;
# - T_GRAD: bench_grad_checks.py (the step's checks, multi-tensor, float32 norms).
# Carry .whl (../shared/gpu/carry-wheels.sh):  T_SAMPLE=300 bash benchmarks/carry/gpu_verify_suite.sh
WHL=1 source benchmarks/carry/gpu_setup.sh
PYT="python3 -m pytest -m gpu -p no:cacheprovider -v -rfE --continue-on-collection-errors --timeout 300"
[ "${T_PROBE:-0}" -gt 0 ] && timeout ${T_PROBE} python3 benchmarks/probe_bf16_margins.py \
  --repeats ${REPEATS:-3} ${FAMILIES:+--families $FAMILIES} --out $OUT 2>&1 | grep -vi warn | tail -32
[ "${T_SAMPLE:-0}" -gt 0 ] && timeout ${T_SAMPLE} $PYT tests/engines/sample \
  -k "not compiled_decode_equals_eager" 2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | cut -c1-300 | tail -40
[ "${T_ENG:-0}" -gt 0 ] && timeout ${T_ENG} $PYT $(ls tests/engines/*.py | grep -v common.py) \
  tests/client/test_handover_gpu.py tests/adapters 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | cut -c1-300 | tail -60
[ "${T_GRAD:-0}" -gt 0 ] && timeout ${T_GRAD} python3 benchmarks/bench_grad_checks.py --out $OUT 2>&1 \
  | grep -E "^\{|^checks|^\||rror" | cut -c1-600 | tail -12
ls $OUT

#!/usr/bin/env bash
# GPU run for decode steps that stage only their block tables' used columns (issue 15 goal 1),
# and the GPU check of the sampler's host-side changes of 2026-12-03 (failed-step recovery,
# provisional prefix-cache keys, cache epochs, steps counted at read-back) and of the zero-row
# LM-head backward: the native engine's and async scheduling's GPU tests (graphs replayed on
# steps of changing widths; fp32 greedy equal to HF generate), the log-prob GPU tests, then
# probe_table_columns.py (the goal-1 shape, the sampler's 2560-column tables, used columns vs
# the whole width in one engine, ABBA). Needs nothing carried.
#   bash benchmarks/carry/gpu_table_columns.sh    (2026-12-03)
. "$(dirname "$0")/gpu_setup.sh"
TESTS=${TESTS:-"tests/engines/sample/test_native_engine_gpu.py tests/engines/sample/test_async_scheduling_gpu.py tests/core/test_logprobs_gpu.py"}
timeout "${T_TESTS:-330}" python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS \
  -k "not compiled_decode_equals_eager" 2>&1 | grep -E "passed|failed|^E |^FAILED" | tail -8
cd benchmarks
timeout "${T_PROBE:-120}" python3 probe_table_columns.py --repeat "${REPEAT:-3}" --out "$OUT" 2>&1 \
  | grep -v -i warn | tail -9

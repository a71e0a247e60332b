#!/usr/bin/env bash
# GPU run for the sampler's decode step (issue 15 goals 1, 3): GPU tests (default: the async-
# scheduling ones, bit-equal to the synchronous engine, and the native engine's), then
# bench_sampler at the goal-1 shape (64 rows, P256) and the goal-3 shape (G16 P4096 S512), then
# probe_decode_gemms.py. Knobs: T_TESTS / T_G1 / T_G3 (seconds per stage, 0 skips it), TESTS
# (the test files), PROBE=0 (skip the probe), REPEAT (runs per bench cell, ABBA order), EARLY
# (--early: both / on / off; default both), FUSE (--fuse: off / on / both; default on), TAG
# (result file names: bench_sampler_<TAG>_<shape>.*, default early), BENCH_ARGS (more
# bench_sampler arguments, e.g. --fca-profiles 2048x1,1024x2).
# 2026-12-03 (early launch): T_TESTS=330 bash benchmarks/carry/gpu_sampler_step.sh
# 2026-12-03, later (fused projections; the tests ran in a call of their own, the stage below
#   was cut by T_TESTS): TESTS="tests/engines/sample/test_fused_projections_gpu.py
#   tests/engines/sample/test_async_scheduling_gpu.py" T_TESTS=230 T_G1=110 T_G3=220 EARLY=on \
#   FUSE=both REPEAT=1 PROBE=0 TAG=fused bash benchmarks/carry/gpu_sampler_step.sh
# 12-03, later still (the Triton planner, then FCA profiles): see BENCHMARKS.md, "Forest plan".
# Needs nothing carried.
. "$(dirname "$0")/gpu_setup.sh"
if [ "${T_TESTS:-240}" != 0 ]; then
  # shellcheck disable=SC2086
  timeout "${T_TESTS:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-\
    tests/engines/sample/test_async_scheduling_gpu.py tests/engines/sample/test_native_engine_gpu.py} \
    -k "not compiled_decode_equals_eager" 2>&1 | grep -E "passed|failed|^E |^FAILED" | tail -20
fi
cd benchmarks

bench() {  # bench <seconds> <name> <bench_sampler args...>
  local t=$1 name=$2
  shift 2
  [ "$t" = 0 ] && return
  mkdir -p "$OUT/tmp"
  # shellcheck disable=SC2086
  timeout "$t" python3 bench_sampler.py "$@" ${BENCH_ARGS:-} --early "${EARLY:-both}" --fuse "${FUSE:-on}" \
    --repeat "${REPEAT:-1}" --out "$OUT/tmp" \
    2>&1 | grep -v Warning | tail -16
  for ext in json png; do
    cp "$OUT/tmp/bench_sampler.$ext" "$OUT/bench_sampler_${TAG:-early}_$name.$ext" 2>/dev/null
  done
  rm -rf "$OUT/tmp"
}

bench "${T_G1:-150}" g8_p256 --groups 8 --G 8 --prompt-len 256 --new-tokens 128 --Gs 8 --kv-gb 8
bench "${T_G3:-200}" g16_p4096 --groups 8 --G 16 --prompt-len 4096 --new-tokens 512 --Gs 16 --kv-gb 40
[ "${PROBE:-1}" = 0 ] || python3 probe_decode_gemms.py --out "$OUT" 2>&1 | tail -2

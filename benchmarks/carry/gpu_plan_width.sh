#!/usr/bin/env bash
# GPU run for the forest plan's passes bounded by each row's own columns (issue 15 goals 3, 4):
# the planner's GPU tests (Triton == torch at the sampler's sizes; a CUDA-graph replay on a
# shorter step reusing a longer step's scratch) and the native engine's, then the decode-call
# probe (plan at 2560 columns and at the forest's own width) at G8 P256 and G16 P4096, then
# bench_sampler at G8 P256 with FCA forced, 2560-column tables (as gpu_fca_threshold.sh).
# Needs nothing carried.   bash benchmarks/carry/gpu_plan_width.sh   (2026-12-03)
. "$(dirname "$0")/gpu_setup.sh"
timeout "${T_TESTS:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_fca_plan_triton.py tests/kernels/test_fca_plan.py \
  tests/engines/sample/test_native_engine_gpu.py -k "not compiled_decode_equals_eager" 2>&1 \
  | grep -E "passed|failed|^E |^FAILED" | tail -12
cd benchmarks
for shape in "8 256 16,64,128" "16 4096 16,512"; do
  set -- $shape
  mkdir -p "$OUT/probe_g$1_p$2"
  timeout "${T_PROBE:-60}" python3 probe_fca_suffix.py --groups 8 --G "$1" --prompt-len "$2" \
    --suffixes "$3" --configs default --out "$OUT/probe_g$1_p$2" 2>&1 | grep -E "^\|" | tail -4
done
mkdir -p "$OUT/tmp"
timeout "${T_BENCH:-100}" python3 bench_sampler.py --groups 8 --G 8 --prompt-len 256 \
  --new-tokens 128 --Gs 8 --kv-gb 8 --fca-min-shared-tokens 0 --max-model-len 0 \
  --repeat "${REPEAT:-3}" --out "$OUT/tmp" 2>&1 | grep -E "speedup|ms/step" | tail -8
for ext in json png; do cp "$OUT/tmp/bench_sampler.$ext" "$OUT/bench_sampler_planwidth_g8_p256.$ext" 2>/dev/null; done
rm -rf "$OUT/tmp"

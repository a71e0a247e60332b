#!/usr/bin/env bash
# GPU run for FCA's per-step threshold (issue 15 goals 3 and 4): where does the forest start to
# pay now that the plan is four Triton launches (0.095 ms at 2560 columns, was 1.5 ms)?
# bench_sampler with FCA forced on every sharing step (--fca-min-shared-tokens 0) against the
# paged kernel, tables as wide as a recipe's sampler has them (--max-model-len 0: 2560 columns
# for Qwen3-0.6B), 8 prompts x G for each PROMPTS length (saved KV reads per layer per step:
# 8 x (G - 1) x P tokens), 128 new tokens, REPEAT runs per cell (ABBA). Then the decode-call
# probe at G8 P256 (attention and plan per layer, FCA vs paged). Needs nothing carried.
#   bash benchmarks/carry/gpu_fca_threshold.sh    (2026-12-03: PROMPTS="128 256 512 1024" GS=8)
. "$(dirname "$0")/gpu_setup.sh"
cd benchmarks
for G in ${GS:-8}; do
  for P in ${PROMPTS:-128 256 512 1024}; do
    mkdir -p "$OUT/tmp"
    timeout "${T_BENCH:-110}" python3 bench_sampler.py --groups 8 --G "$G" --prompt-len "$P" \
      --new-tokens 128 --Gs "$G" --kv-gb 8 --fca-min-shared-tokens 0 --max-model-len 0 \
      --repeat "${REPEAT:-2}" --out "$OUT/tmp" 2>&1 | grep -E "speedup|ms/step" | tail -6
    for ext in json png; do
      cp "$OUT/tmp/bench_sampler.$ext" "$OUT/bench_sampler_threshold_g${G}_p$P.$ext" 2>/dev/null
    done
    rm -rf "$OUT/tmp"
  done
done
[ "${PROBE:-1}" = 0 ] || timeout "${T_PROBE:-90}" python3 probe_fca_suffix.py --groups 8 --G 8 \
  --prompt-len 256 --suffixes 16,64,128 --configs "default,chunk1024 sh2/sm" --out "$OUT" \
  2>&1 | tail -12

#!/usr/bin/env bash
# One H200 call (issue 15, 2026-12-02): the FCA kernels' GPU tests with the new shared-pass
# default, the GSM8K recipe with the default "auto" hand-over in four arms (ZoRRo+FCA / naive+paged,
# eager / compiled layers, one process), the SkyRL worker against the packed naive layout, then
# the sampler's FCA vs paged at G16 P4096 (T_SAMPLER), and bench_fca's shapes (T_FCA). Carry .whl (../shared/gpu/carry-wheels.sh).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
 && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
[ "${T_TESTS:-80}" -gt 0 ] && timeout ${T_TESTS:-80} python3 -m pytest -q -m gpu tests/kernels/test_fca_decode.py \
  -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/tests.txt
[ "${T_FCA:-0}" -gt 0 ] && timeout ${T_FCA} python3 benchmarks/bench_fca.py --no-sdpa --out $OUT/fca 2>&1 \
  | grep -v Warning | grep -E "^\||copy" | tail -8
[ "${T_RECIPE:-270}" -gt 0 ] && timeout ${T_RECIPE:-270} python3 benchmarks/bench_recipe.py --task gsm8k --steps ${STEPS:-6} \
  --arms ${ARMS:-zorro,naive,zorro+compiled,naive+compiled} --offload ${OFFLOAD:-auto} --budget-s $(( ${T_RECIPE:-270} - 20 )) \
  --out $OUT/recipe 2>&1 | grep -v Warning | grep -E "^\||speedup|skipping" | tail -12
[ "${T_SKYRL:-110}" -gt 0 ] && timeout ${T_SKYRL:-110} python3 benchmarks/bench_skyrl_worker.py --iters 3 \
  --out $OUT/skyrl 2>&1 | grep -v Warning | tail -6
[ "${T_SAMPLER:-0}" -gt 0 ] && timeout ${T_SAMPLER} python3 benchmarks/bench_sampler.py --groups 8 --G 16 \
  --prompt-len 4096 --new-tokens 512 --Gs 16 --compile on --kv-gb 40 --out $OUT/sampler 2>&1 \
  | grep -v Warning | tail -8
ls -R $OUT | head -30

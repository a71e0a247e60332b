#!/usr/bin/env bash
# One H200 call (issue 15, 2026-12-03): FCA through a generation's suffix lengths at the sampler's
# shape, with the forest plan's time per backend (probe_fca_suffix.py, T_PROBE), GPU tests
# (T_TESTS; TESTS, default: weight sync / hand-over), and a recipe, default the long-context QA
# task with ZoRRo+FCA vs the packed naive arm (T_RECIPE, STEPS, TASK, ARMS). PROBE_ARGS: extra
# probe arguments (e.g. --suffixes 16,256,512); RECIPE_ARGS: extra bench_recipe arguments (e.g.
# --set client.sampling.fca_chunk_tokens=1024).
# Carry .whl (../shared/gpu/carry-wheels.sh). Next (the Triton planner, compiled layers):
#   TESTS="tests/kernels/test_fca_plan_triton.py tests/kernels/test_fca_plan.py" T_TESTS=120 \
#   ARMS=zorro+compiled,naive+compiled bash benchmarks/carry/gpu_suffix_longqa.sh   (ran 12-03)
# 12-03, later (the rewritten class pass; then the sampler): see BENCHMARKS.md, "Forest plan".
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
 && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
[ "${T_PROBE:-150}" -gt 0 ] && timeout ${T_PROBE:-150} python3 benchmarks/probe_fca_suffix.py \
  --out $OUT ${PROBE_ARGS:-} 2>&1 | grep -v Warning | grep -E "^\||mean|Error|error" | tail -12
[ "${T_TESTS:-100}" -gt 0 ] && timeout ${T_TESTS:-100} python3 -m pytest -q -m gpu -p no:cacheprovider \
  ${TESTS:-tests/sync/test_sync_gpu.py tests/client/test_handover_gpu.py} 2>&1 | grep -E "passed|failed|^E |^FAILED" | tail -8
[ "${T_RECIPE:-300}" -gt 0 ] && timeout ${T_RECIPE:-300} python3 benchmarks/bench_recipe.py --task ${TASK:-longqa} \
  --steps ${STEPS:-4} --arms ${ARMS:-zorro,naive} --budget-s $(( ${T_RECIPE:-300} - 15 )) --out $OUT/recipe ${RECIPE_ARGS:-} 2>&1 \
  | grep -v Warning | grep -E "^\||speedup|skipping|Error|rror:" | tail -14
ls $OUT $OUT/recipe 2>/dev/null

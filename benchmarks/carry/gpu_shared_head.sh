#!/usr/bin/env bash
# Issue 15 goal 4, written 2026-12-07; ran that day on an H100 (BENCHMARKS). One call; stages run
# tests first (T_TESTS, T_GRAD, T_HEAD, T_RECIPE, T_PROBE), each skipped with its T_* = 0:
# - T_HEAD: probe_shared_head.py — the long-context micro-batch (8 groups of 6400/128/8) with an
#   11-token common head, shared (old layout) vs repeated (MIN_SHARED_TOKENS) vs no head, with
#   both layouts checked against the packed naive layout on the device;
# - T_RECIPE: the long-context recipe, both arms compiled, one 65,536-token micro-batch, step 2's
#   trainer calls profiled (wall vs GPU-busy, allocator, Dynamo compiles, GC, threads);
# - T_PROBE: probe_fresh_compiled.py's engine with the same budget, profiled, on the same machine,
#   so that the recipe's forward/backward is compared with the bare engine's on one host;
# - T_TESTS: the GPU tests whose batches changed (random_batch's system prompt, 2026-12-07) and the
#   multi-tensor gradient checks' GPU tests (or TESTS="...");
# - T_GRAD: bench_grad_checks.py — the ZeRO-2 step with DeepSpeed's per-tensor gradient checks vs
#   the multi-tensor ones vs those and fused AdamW, interleaved, answers compared on the device first.
# Carry .whl (../shared/gpu/carry-wheels.sh):  bash benchmarks/carry/gpu_shared_head.sh
WHL=1 source benchmarks/carry/gpu_setup.sh
[ "${T_TESTS:-0}" -gt 0 ] && timeout ${T_TESTS} python3 -m pytest -q -m gpu -p no:cacheprovider \
  ${TESTS:-tests/core/test_logprobs_gpu.py tests/kernels/test_zorro_split.py tests/engines/test_grad_checks.py} 2>&1 | tail -4
[ "${T_GRAD:-0}" -gt 0 ] && timeout ${T_GRAD} python3 benchmarks/bench_grad_checks.py --out $OUT 2>&1 \
  | grep -E "^\{|^checks|rror" | cut -c1-600 | tail -5
[ "${T_HEAD:-150}" -gt 0 ] && timeout ${T_HEAD:-150} python3 benchmarks/probe_shared_head.py \
  --rounds ${ROUNDS:-3} --out $OUT 2>&1 | grep -E "^\{|^head|^no |correct|rror" | cut -c1-400 | tail -8
MB="--set client.train.micro_batch_tokens=65536 --set client.logprob.micro_batch_tokens=65536"
[ "${T_RECIPE:-260}" -gt 0 ] && timeout ${T_RECIPE:-260} python3 benchmarks/bench_recipe.py --task longqa \
  --steps ${STEPS:-4} --arms ${ARMS:-zorro+compiled,naive+compiled} --budget-s $(( ${T_RECIPE:-260} - 15 )) \
  --profile-step 2 --direct-calls 1 $MB --out $OUT/recipe 2>&1 | grep -v Warning \
  | grep -E "^\||speedup|skipping|Error|rror:|'forward_backward_s'" | cut -c1-700 | tail -16
[ "${T_PROBE:-120}" -gt 0 ] && (cd benchmarks && timeout ${T_PROBE:-120} python3 probe_fresh_compiled.py \
  --groups 8 --modes engine --micro-batch-tokens 65536 --profile --repeat 2 --fresh 3 --out $OUT \
  2>&1 | grep -E "^\{|rror" | cut -c1-700 | tail -5)
ls $OUT $OUT/recipe 2>/dev/null

#!/usr/bin/env bash
# Written 2026-12-07 (afternoon session) for one device call (carry .whl); it ran on an H100:
# - T_TEST: the GPU tests of what changed since the last device call (the FCA kernel's tile
#   helpers, the sampler's vLLM filter order, the LM-head logit scale, the weight-transfer
#   receive on CUDA, min_tokens on the ahead path) and the log-prob / compiled-layer / native
#   engine tests the FlexAttention fresh-compile change touched; TESTS overrides the list;
# - T_FCA: bench_fca.py on 8x16 P4096 S512 and 32x16 P4096 S512 with the sweep (issue 15
#   goal 8; the software-pipelined shared tiles it also swept then were slower and are gone);
# - T_SUFFIX: probe_fca_suffix.py (Qwen3-0.6B heads, S 16..512), default vs 1024-token chunks.
WHL=1 source benchmarks/carry/gpu_setup.sh
PYT="python3 -m pytest -m gpu -p no:cacheprovider -v -rfE --continue-on-collection-errors"
TESTS=${TESTS:-"tests/kernels/test_fca_decode.py tests/core/test_head_scale.py
  tests/client/test_transfer_receive.py tests/engines/sample/test_vllm_semantics.py
  tests/engines/sample/test_min_tokens.py tests/core/test_logprobs_gpu.py
  tests/core/test_compiled_layers_gpu.py tests/engines/sample/test_native_engine_gpu.py"}
[ "${T_TEST:-0}" -gt 0 ] && timeout ${T_TEST} $PYT $TESTS -k "not compiled_decode_equals_eager" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | cut -c1-300 | tail -90
[ "${T_FCA:-0}" -gt 0 ] && timeout ${T_FCA} python3 benchmarks/bench_fca.py --shapes 0,1 \
  --no-sdpa --out $OUT/fca 2>&1 | grep -v -i warn | cut -c1-2500 | tail -30
[ "${T_SUFFIX:-0}" -gt 0 ] && timeout ${T_SUFFIX} python3 benchmarks/probe_fca_suffix.py \
  --configs "default,chunk1024 sh2/sm" --out $OUT/suffix 2>&1 \
  | grep -E "^\||mean|rror" | cut -c1-400 | tail -12
ls -R $OUT | head

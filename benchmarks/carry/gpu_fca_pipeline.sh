#!/usr/bin/env bash
# Written 2026-12-07 (afternoon session), one device call (carry .whl):
# - T_TEST: the GPU tests of what changed since the last device call — FCA's pipelined shared
#   tiles (tests/kernels/test_fca_decode.py), the sampler's vLLM filter order, the LM-head logit
#   scale, the weight-transfer receive on CUDA, min_tokens on the ahead path — and the log-prob / compiled-layer / native
#   engine tests that the FlexAttention fresh-compile change touched;
# - T_FCA: bench_fca.py on 8x16 P4096 S512 and 32x16 P4096 S512 with the sweep (pipelined
#   shared tiles among its entries; issue 15 goal 8).
WHL=1 source benchmarks/carry/gpu_setup.sh
PYT="python3 -m pytest -m gpu -p no:cacheprovider -v -rfE --continue-on-collection-errors"
[ "${T_TEST:-0}" -gt 0 ] && timeout ${T_TEST} $PYT tests/kernels/test_fca_decode.py \
  tests/core/test_head_scale.py tests/client/test_transfer_receive.py \
  tests/engines/sample/test_vllm_semantics.py tests/engines/sample/test_min_tokens.py \
  tests/core/test_logprobs_gpu.py \
  tests/core/test_compiled_layers_gpu.py tests/engines/sample/test_native_engine_gpu.py \
  -k "not compiled_decode_equals_eager" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | cut -c1-300 | tail -90
[ "${T_FCA:-0}" -gt 0 ] && timeout ${T_FCA} python3 benchmarks/bench_fca.py --shapes 0,1 \
  --no-sdpa --out $OUT/fca 2>&1 | grep -v -i warn | cut -c1-2500 | tail -30
ls -R $OUT | head

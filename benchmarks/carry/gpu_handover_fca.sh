#!/usr/bin/env bash
# One H200 call (issue 15, 2026-12-02): the shared-pass sweep of FCA (bench_fca, first shape, at
# Hq32 and at the Qwen3-0.6B head ratio Hq16), then the GPU tests of the "auto" hand-over, the TRL
# adapter's defaults and the FCA kernels. Carry .whl (../shared/gpu/carry-wheels.sh) and
# .whl-trl-1 (benchmarks/carry/trl-wheels.sh). Time limits per step: T_FCA, T_TESTS.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-trl-1/*.whl \
 && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
for hq in 32 16; do
  timeout ${T_FCA:-120} python3 benchmarks/bench_fca.py --shapes ${FCA_SHAPES:-0} --hq $hq --no-sdpa \
    --out $OUT/fca_hq$hq 2>&1 | grep -v Warning | grep -E "copy|fca_sweep_graph|shape" | head -4
done
timeout ${T_TESTS:-300} python3 -m pytest -q -m gpu tests/client/test_handover_gpu.py tests/adapters/test_trl_gpu.py \
  tests/kernels/test_fca_decode.py -p no:cacheprovider 2>&1 | tail -12 | tee $OUT/tests.txt
ls $OUT

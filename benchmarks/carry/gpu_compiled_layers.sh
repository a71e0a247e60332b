#!/usr/bin/env bash
# One H200 call: compiled layers' GPU tests, the one-group micro-batch scan and profile, then the
# TRL GSM8K step (compiled / eager adapter vs TRL). Needs .whl-trl-1 carried
# (benchmarks/carry/trl-wheels.sh). Each step's time limit can be set (T_TESTS, T_SCAN, ...).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-trl-1/*.whl \
 && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout ${T_TESTS:-200} python3 -m pytest -q -m gpu tests/core/test_compiled_layers_gpu.py tests/adapters/test_trl_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/tests.txt
timeout ${T_SCAN:-90} python3 benchmarks/profile_zorro_step.py --scan ${SCAN:-256/128/8x1,256/128/8x4} \
  --arms naive,auto --compiled --rounds 7 --out $OUT 2>&1 | grep -v Warning | tail -8
[ "${T_PROFILE:-50}" -gt 0 ] && timeout ${T_PROFILE:-50} python3 benchmarks/profile_zorro_step.py --shape 256/128/8 --groups 1 \
  --arms naive --compiled --iters 3 --out $OUT 2>&1 | grep -v Warning | tail -4
[ "${T_TRL:-230}" -gt 0 ] && timeout ${T_TRL:-230} python3 benchmarks/bench_trl_step.py --shapes ${SHAPES:-gsm8k} --steps 4 \
  --polynya-arms ${POLYNYA_ARMS:-polynya-compiled,polynya} --trl-arms ${TRL_ARMS:-dynamic} --out $OUT 2>&1 \
  | grep -v Warning | tail -25
ls $OUT

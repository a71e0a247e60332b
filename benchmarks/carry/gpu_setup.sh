# Sourced by the GPU scripts: $OUT made, polynya installed from the work tree into /tmp/site
# (on PYTHONPATH), the card's clocks printed. WHL=1: also the carried .whl folder's wheels
# (DeepSpeed, Hydra: ../shared/gpu/carry-wheels.sh), for the engines and the recipes.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${WHL:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader

# Sourced by the GPU scripts that need nothing carried: $OUT made, polynya installed from the
# work tree into /tmp/site (on PYTHONPATH), the card's clocks printed.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader

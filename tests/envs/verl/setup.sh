#!/usr/bin/env bash
# Creates .venvs/verl: polynya + stock verl 0.9.1 on the CPU torch wheel (idempotent).
#
# verl pins transformers<5.11 and pulls Ray, tensordict, wandb, ...; its tests therefore run in
# their own environment (tests/run.py runs the paths listed in ./paths there). Only verl's base
# dependencies are installed: its extras (vllm, sglang, fsdp, megatron, cpu) pin torch 2.11 and
# GPU packages and are not needed to import verl, compose its config or drive an engine.
# Exit 0 = ready, 3 = this machine cannot host it (python3 < 3.10), other = failure.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
HERE="$ROOT/tests/envs/verl"
VENV="$ROOT/.venvs/verl"
cd "$ROOT"

if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "verl env: python3 >= 3.10 needed, found $(python3 --version 2>&1)"
    exit 3
fi
# Rebuild only when the files that define the environment change.
KEY="$(cat pyproject.toml "$HERE/setup.sh" "$HERE/constraints.txt" | sha256sum | cut -d' ' -f1)"
STAMP="$VENV/.polynya-env-key"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && [ -x "$VENV/bin/python" ]; then
    exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q -c "$HERE/constraints.txt")
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[verl,deepspeed,recipes]' 'pytest>=8' 'pytest-timeout>=2.3'
"$VENV/bin/python" - <<'PY'
import torch, transformers, verl  # noqa: F401  (fails loudly if the env is not usable)
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"verl env: verl {verl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$KEY" > "$STAMP"
echo "verl env: created in $(( $(date +%s) - start )) s"

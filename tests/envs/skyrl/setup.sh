#!/usr/bin/env bash
# Creates .venvs/skyrl (idempotent; tests/run.py calls it): CPython 3.12 with stock skyrl==0.4.0
# and skyrl-gym==0.4.0 installed --no-deps, polynya itself with the extra "skyrl" (what SkyRL's
# HTTP client, weight-sync control plane and training batch import; pyproject.toml) plus
# deepspeed/http for the policy-worker tests, and requirements.txt. The polynya server the
# tests drive runs from the main .venv (CPython 3.11), so SkyRL talks to it over HTTP as a user's
# would. Exit 3 (printed reason) = this machine cannot host the environment.
#
# Why this is the size it is: SkyRL 0.4.0 needs CPython >= 3.12 (on 3.11 its tinker types fail
# in pydantic: "use typing_extensions.TypedDict on Python < 3.12"), its RemoteInferenceClient
# module imports torch (skyrl/backends/skyrl_train/utils/sample_support.py), and the only torch
# PyPI has for CPython 3.12 on x86_64 is the CUDA build: about 5.5 GB installed with its nvidia-*
# wheels (it runs on the CPU). The project's CPU wheel torch==2.13.0 is cp311 only.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
HERE="$ROOT/tests/envs/skyrl"
VENV="$ROOT/.venvs/skyrl"
NEED_GB=12

PY=""
for cand in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    # (a pyenv shim on PATH may exist yet refuse to run: try each candidate)
    if [ -x "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        PY="$cand"; break
    fi
done
if [ -z "$PY" ]; then
    echo "skyrl env: SkyRL 0.4.0 needs CPython 3.12; no python3.12 on PATH or under ~/.pyenv/versions"
    exit 3
fi
STAMP_WANT="$(cat "$HERE/requirements.txt" "$0" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ -f "$VENV/.stamp" ] && [ "$(cat "$VENV/.stamp")" = "$STAMP_WANT" ]; then
    exit 0
fi
mkdir -p "$ROOT/.venvs"
FREE_GB=$(( $(df -Pk "$ROOT/.venvs" | awk 'NR==2 {print $4}') / 1048576 ))
if [ "$FREE_GB" -lt "$NEED_GB" ]; then
    echo "skyrl env: needs ~${NEED_GB} GB free for CPython 3.12's torch (CUDA build); ${FREE_GB} GB free"
    exit 3
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" -r "$HERE/requirements.txt" -e "$ROOT[deepspeed,http,skyrl]"
"${PIP[@]}" --no-deps skyrl==0.4.0 skyrl-gym==0.4.0
"$VENV/bin/python" - <<'PYCHECK'
import skyrl, skyrl_gym, polynya  # noqa: F401
import skyrl.backends.skyrl_train.inference_servers.remote_inference_client  # noqa: F401
import skyrl.backends.skyrl_train.training_batch  # noqa: F401
assert skyrl.__version__ == "0.4.0", skyrl.__version__
PYCHECK
echo "$STAMP_WANT" > "$VENV/.stamp"
echo "skyrl env ready: $VENV"

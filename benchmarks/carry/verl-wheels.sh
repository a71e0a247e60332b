#!/usr/bin/env bash
# Wheels that `import verl` (0.9.1) and polynya.adapters.verl.engine need on the GPU machine
# (Python 3.12, torch 2.11, transformers 5.17, no package index) for benchmarks/bench_verl_engine.py:
# the distributions those imports load (read off sys.modules in .venvs/verl: Ray and its import-time
# deps, tensordict, datasets/pandas/pyarrow, peft, fastapi, ...), less what torch 2.11 and
# transformers 5.17 bring. DeepSpeed, Hydra and pydantic come from ../shared/gpu/carry-wheels.sh.
# Usage, from anywhere in the work tree:
#
#   bash benchmarks/carry/verl-wheels.sh [HAVE_FILE]      # AFTER_TRL=1: TRL's wheels are installed
#
# HAVE_FILE: the machine's `python3 -m pip list` (or freeze); requirements it satisfies are
# skipped (with the H200's list of 2026-11-30: 84 MB in two folders). AFTER_TRL=1 also leaves out
# what benchmarks/carry/trl-wheels.sh put in .site-trl on a machine still warm. Ray's wheel
# (79 MB) is larger than one call carries: it is cut into .partNN pieces in consecutive folders,
# joined with `cat` and checked with `sha256sum -c` on the machine (benchmarks/carry/README.md).
set -euo pipefail
source "$(dirname "$0")/wheels.sh"
have=${1:-}
reqs=(verl==0.9.1 ray==2.60.0 'tensordict==0.10.0' 'pyvers>=0.1,<0.2' orjson cloudpickle codetiming
      'peft>=0.21' msgpack 'protobuf>=3.20.3' 'jsonschema>=4' jsonschema-specifications
      referencing rpds-py 'attrs>=22.2' colorful requests urllib3 charset-normalizer
      'fastapi>=0.110' starlette 'uvicorn>=0.29' annotated-doc 'opentelemetry-api>=1.44' pillow
      rich pygments markdown-it-py mdurl)
if [ "${AFTER_TRL:-0}" != 1 ]; then
  reqs+=(accelerate==1.15.0 datasets==5.2.0 'dill>=0.3,<0.4.2' 'multiprocess<0.70.20' xxhash
         'pyarrow>=24,<27' 'pandas>=2.1.1,<3.2' 'python-dateutil>=2.9,<3' 'six>=1.5' 'psutil>=5.9.4')
fi
carry_wheels verl "$have" "${reqs[@]}"

#!/usr/bin/env bash
# Wheels that benchmarks/bench_trl_step.py needs on the GPU machine (Python 3.12, torch 2.11,
# transformers 5.17, no package index): TRL 1.16 and what it imports (accelerate, datasets and
# theirs), at the versions the project's CPU tests run. Usage, from anywhere in the work tree:
#
#   bash benchmarks/carry/trl-wheels.sh [HAVE_FILE]
#
# HAVE_FILE: the machine's `python3 -m pip list` (or freeze) output; requirements it satisfies are
# skipped: with the H200's list of 2026-11-30 that leaves trl, datasets, dill and multiprocess
# (1.8 MB, one folder). Without it only torch's and transformers' own dependencies are assumed
# (jinja2, markupsafe, fsspec, huggingface_hub, ...), and the rest is 70 MB (pyarrow 55, pandas
# 12): two folders, .whl-trl-1 and .whl-trl-2, for two consecutive device calls. The device
# commands are in benchmarks/carry/README.md.
set -euo pipefail
source "$(dirname "$0")/wheels.sh"
have=${1:-}
reqs=(trl==1.16.0 accelerate==1.15.0 datasets==5.2.0 'dill>=0.3,<0.4.2' 'multiprocess<0.70.20'
      xxhash 'pyarrow>=24,<27' 'pandas>=2.1.1,<3.2' 'python-dateutil>=2.9,<3' 'six>=1.5' 'psutil>=5.9.4')
if [ -n "$have" ]; then
  reqs+=('jinja2>=3' 'fsspec>=2023.1.0,<=2026.9.0' 'huggingface-hub>=1.31,<3' 'markupsafe>=2')
fi
carry_wheels trl "$have" "${reqs[@]}"

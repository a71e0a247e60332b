#!/usr/bin/env bash
# Wheels that benchmarks/bench_trl_step.py needs on the GPU machine (Python 3.12, torch 2.11,
# transformers 5.17, no package index): TRL 1.16 and what it imports (accelerate, datasets and
# theirs), at the versions the project's CPU tests run. Usage, from anywhere in the work tree:
#
#   bash benchmarks/carry/trl-wheels.sh [HAVE_FILE]
#
# HAVE_FILE: the machine's `python3 -m pip list` (or freeze) output; requirements it satisfies are
# skipped (without it: torch 2.11 and transformers 5.17 already bring jinja2, markupsafe, fsspec,
# numpy, pyyaml, packaging, filelock, tqdm, huggingface_hub and safetensors, so these are left
# out). Everything else comes to 70 MB (pyarrow 55 MB, pandas 12 MB, ...), so the script packs it
# into two ignored folders, .whl-trl-1 and .whl-trl-2, for two consecutive device calls (the
# machine keeps ignored folders between calls while warm). It prints the folders; the device
# commands are in benchmarks/carry/README.md.
set -euo pipefail
source "$(dirname "$0")/wheels.sh"
have=${1:-}
reqs=(trl==1.16.0 accelerate==1.15.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
      xxhash==4.1.0 'pyarrow>=24,<27' 'pandas>=2.1.1,<3.2' 'python-dateutil>=2.9' tzdata 'psutil>=5.9.4')
if [ -n "$have" ]; then
  reqs+=('jinja2>=3' 'fsspec>=2023.1.0,<=2026.9.0' 'huggingface-hub>=1.31,<3' 'markupsafe>=2')
fi
carry_wheels trl "$have" "${reqs[@]}"

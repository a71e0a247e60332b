"""torchrun worker for ``test_dp.py``: ``dp_scenario`` for each ZeRO stage on every rank; rank 0
saves the results to ``argv[1]`` (checkpoints under ``argv[2]``)."""
import os
import sys

import torch

from tests.engines.common import dp_scenario

if __name__ == "__main__":
    out, ckpt = sys.argv[1], sys.argv[2]
    stages = [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0, 1, 2, 3]
    results = {s: dp_scenario(s, os.path.join(ckpt, f"stage{s}")) for s in stages}
    if int(os.environ["RANK"]) == 0:
        torch.save(results, out)

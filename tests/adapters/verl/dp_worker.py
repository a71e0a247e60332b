"""torchrun worker for ``test_dp.py``: rank r trains the ``deepspeed`` backend on its share of a
verl batch (rank 0: the first group, rank 1: the other two); rank 0 saves loss, grad norm,
weights and both ranks' micro-batch counts to ``argv[1]``."""
import os
import sys

import torch
import torch.distributed as dist

from tests.adapters.verl.test_dp import one_step

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    loss, norm, weights, micro = one_step(rows=[0, 1, 2] if rank == 0 else [3, 4, 5, 6, 7, 8])
    total = torch.tensor([loss])
    dist.all_reduce(total, op=dist.ReduceOp.AVG)  # what verl's TrainingWorker reports
    counts = [None, None]
    dist.all_gather_object(counts, micro)
    if rank == 0:
        torch.save({"loss": float(total), "grad_norm": norm, "weights": weights, "micro": counts}, sys.argv[1])

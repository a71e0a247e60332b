"""Data-parallel ranks must be given the same global batch, rows in the same order, with the
same advantages and log-probs: each rank takes its shard by row index, and the planner breaks
ties between equal prompt groups by position. A rank given the same samples in another order
would otherwise train one group twice and another never, silently (``polynya.distributed.batch_fingerprint``, which the log-prob engine's shards
also check: rows in another order would get their log-probs put in other rows).

The torchrun half runs this file as a script on 2 ranks (gloo)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from polynya import RolloutBatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def equal_groups(order=None, shift: float = 0.0) -> RolloutBatch:
    """4 prompt groups of the same token cost (planner ties), rows in ``order``."""
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for _ in range(4):
        prompt = torch.randint(2, 500, (5,), generator=g).tolist()
        for _ in range(2):
            prompts.append(prompt)
            responses.append(torch.randint(2, 500, (3,), generator=g).tolist())
    adv = torch.randn(8, generator=g)
    old = -torch.rand(8, 3, generator=g)
    order = list(range(8)) if order is None else order
    return RolloutBatch([prompts[i] for i in order], [responses[i] for i in order],
                        advantages=adv[order] + shift, old_logprobs=old[order])


SWAPPED = [2, 3, 0, 1, 4, 5, 6, 7]  # groups 0 and 1 swapped: same samples, other order


def fingerprint(batch: RolloutBatch) -> list[int]:
    """What the training engine checks: the rows in order and the tensors its loss reads."""
    from polynya.distributed import batch_fingerprint

    return batch_fingerprint(batch, (batch.advantages, batch.old_logprobs, batch.ref_logprobs))


def test_fingerprint_sees_order_and_tensors():
    from polynya.distributed import batch_fingerprint

    assert batch_fingerprint(equal_groups(SWAPPED)) != batch_fingerprint(equal_groups())  # rows alone

    base = fingerprint(equal_groups())
    assert fingerprint(equal_groups()) == base
    assert fingerprint(equal_groups(SWAPPED)) != base
    assert fingerprint(equal_groups(shift=1e-6)) != base
    b = equal_groups()
    no_old = RolloutBatch(b.prompts, b.responses, advantages=b.advantages)
    ref = RolloutBatch(b.prompts, b.responses, advantages=b.advantages, old_logprobs=b.old_logprobs,
                       ref_logprobs=b.old_logprobs)
    grouped = RolloutBatch(b.prompts, b.responses, group_ids=[0, 0, 1, 1, 2, 2, 3, 3],
                           advantages=b.advantages, old_logprobs=b.old_logprobs)
    assert len({tuple(fingerprint(x)) for x in (b, no_old, ref, grouped)}) == 4


@pytest.mark.slow
def test_two_ranks_refuse_a_reordered_or_different_batch(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = tmp_path / "out.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.abspath(__file__), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = torch.load(out)
    assert got["reordered"] == got["shifted"] == got["logprobs_reordered"] == "refused"
    # and the engine was left untouched: the agreed batch trains as on one rank
    from polynya.engines.train import TrainingEngine

    from tests.engines.common import train_config

    one = TrainingEngine(train_config(2, micro_batch_tokens=1000))
    loss = one.forward_backward(equal_groups())["loss"]
    assert got["loss"] == pytest.approx(loss, rel=1e-6)
    assert got["grad_norm"] == pytest.approx(one.step()["grad_norm"], rel=1e-6)


def _worker(out: str) -> None:
    from polynya.engines.train import TrainingEngine

    from tests.engines.common import train_config

    rank = int(os.environ["RANK"])
    engine = TrainingEngine(train_config(2, micro_batch_tokens=1000))
    got = {}
    for name, mine in (("reordered", equal_groups(SWAPPED)), ("shifted", equal_groups(shift=0.5))):
        try:
            engine.forward_backward(mine if rank == 1 else equal_groups())
            got[name] = "trained"
        except ValueError as exc:
            assert "differs between data-parallel ranks" in str(exc), exc
            got[name] = "refused"
    got["loss"] = engine.forward_backward(equal_groups())["loss"]
    got["grad_norm"] = engine.step()["grad_norm"]
    from polynya.config.logprob import LogProbConfig
    from polynya.engines.logprob import LogProbEngine

    from tests.engines.common import MODEL

    ref = LogProbEngine(LogProbConfig(MODEL, dtype="float32", micro_batch_tokens=1000))
    try:  # the log-prob engine's shards: rows in another order would get others' log-probs
        ref.compute_logprobs(equal_groups(SWAPPED) if rank == 1 else equal_groups())
        got["logprobs_reordered"] = "computed"
    except ValueError as exc:
        assert "differs between data-parallel ranks" in str(exc), exc
        got["logprobs_reordered"] = "refused"
    if rank == 0:
        torch.save(got, out)
    import torch.distributed as dist

    dist.barrier()  # leave together: a rank exiting while the other's gloo threads run aborted once
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])

"""Two data-parallel ranks (torchrun, gloo) of the ``deepspeed`` backend, each given its own
share of a verl batch as verl's dispatch does, make the same update as one rank given it all.

The shares are uneven (rank 0: one group, rank 1: two), so the ranks have different numbers of
micro-batches and the engine pads the shorter with a weight-0 repeat (ZeRO-2 reduces in every
backward: the counts must match); verl's
loss is normalised by the global token count times ``dp_size``, DeepSpeed averages over ranks.
Compared: verl's reported loss (the ranks' average), the global grad norm, every weight.
"""
from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def one_step(rows: list[int] | None = None):
    """Build the engine (ZeRO-2, fp32, ZoRRo), train one step on ``rows`` of the test batch;
    return (summed micro-batch losses, grad norm, full weights, real micro-batches)."""
    from polynya.adapters.verl.engine import DeepSpeedLMEngine
    from polynya.adapters.verl.settings import DeepSpeedEngineConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPOptimizerConfig
    from verl.workers.utils.losses import ppo_loss

    from tests.adapters.verl.test_engine import SEED, actor_config, make
    from tests.engines.common import full_weights

    cfg = DeepSpeedEngineConfig(dtype="float32", zero_stage=2, zorro=True, seed=SEED, use_dynamic_bsz=True,
                                max_token_len_per_gpu=40)
    model = SimpleNamespace(path="tiny:qwen3", local_path=None, lora_rank=0, enable_gradient_checkpointing=False)
    engine = DeepSpeedLMEngine(model, cfg, FSDPOptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1e9,
                                                                  override_optimizer_config={"eps": 1e-3}))
    engine.initialize()
    data, _ = make()
    if rows is not None:
        data = tu.index_select_tensor_dict(data, torch.tensor(rows))
    engine.optimizer_zero_grad()
    out = engine.forward_backward_batch(data, partial(ppo_loss, config=actor_config()))
    norm = engine.optimizer_step()
    return sum(out["loss"]), norm, full_weights(engine.trainer.module), len(out["loss"])


@pytest.mark.slow
def test_two_ranks_each_with_its_share_equal_one_rank(tmp_path):
    out = tmp_path / "two.pt"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "tests", "adapters", "verl", "dp_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=500, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    two = torch.load(out, weights_only=False)
    loss, norm, weights, _ = one_step()
    assert two["micro"] == [1, 2]
    assert two["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for name, w in weights.items():  # eps 1e-3: AdamW's first step does not amplify ~0 gradients
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-6)

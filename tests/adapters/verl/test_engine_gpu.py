"""The ``deepspeed`` backend on CUDA (bf16, ZeRO-2): ZoRRo on and off give the same loss,
log-probs and gradient norm within bf16 error on a verl batch (skipped without a GPU; needs
verl, i.e. a machine where ``polynya[verl]`` installs)."""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
from polynya.adapters.verl.engine import DeepSpeedLMEngine
from polynya.adapters.verl.settings import DeepSpeedEngineConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPOptimizerConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from .test_engine import actor_config, make


@pytest.mark.gpu
def test_zorro_on_off_agree_in_bf16_on_cuda(monkeypatch):
    import polynya.logprobs

    monkeypatch.setattr(polynya.logprobs, "ZORRO_MIN_WORK", 0)  # small batch: keep ZoRRo on ZoRRo
    results = []
    for zorro in (True, False):
        cfg = DeepSpeedEngineConfig(dtype="bfloat16", zero_stage=2, zorro=zorro, seed=42, use_dynamic_bsz=True,
                                    max_token_len_per_gpu=4096)
        model = SimpleNamespace(path="tiny:qwen3", local_path=None, lora_rank=0, enable_gradient_checkpointing=False)
        engine = DeepSpeedLMEngine(model, cfg, FSDPOptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=1e9))
        engine.initialize()
        data, (*_, mask) = make()
        tu.assign_non_tensor(data, compute_loss=False)
        lp = no_padding_2_padding(engine.infer_batch(data)["model_output"]["log_probs"], data).float().cpu()
        data, _ = make()
        out = engine.forward_backward_batch(data, partial(ppo_loss, config=actor_config()))
        results.append((sum(out["loss"]), engine.optimizer_step(), lp * mask))
    (l1, g1, lp1), (l0, g0, lp0) = results
    assert l1 == pytest.approx(l0, rel=2e-2, abs=1e-3) and g1 == pytest.approx(g0, rel=2e-2)
    assert float((lp1 - lp0).abs().max()) < 5e-2

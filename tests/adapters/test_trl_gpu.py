"""The TRL adapter on a GPU with its defaults: the decoder layers are compiled
(``compile_layers=None`` -> on for a one-process CUDA run), 3 GRPO steps train, and on every
call the adapter's per-token log-probs and entropy equal TRL's own implementation on the same
batch (fp32, Inductor, 1e-4), the policy's and the reference model's alike."""
from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
from polynya.adapters.trl import GRPOTrainer  # noqa: E402
from polynya.compiled_layers import compiled_modules  # noqa: E402
from polynya.config import SamplerConfig  # noqa: E402
from polynya.models import tiny_tokenizer  # noqa: E402

from .test_trl_compiled import check_logprobs_against_trl  # noqa: E402
from .test_trl_trainer import _args, _dataset, model_dir, reward_digits  # noqa: E402, F401 (fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_defaults_compile_on_gpu_and_equal_trl_logprobs(model_dir, tmp_path):  # noqa: F811
    trainer = GRPOTrainer(model_dir, reward_funcs=reward_digits,
                          args=_args(tmp_path, use_cpu=False, beta=0.04),
                          train_dataset=_dataset(), processing_class=tiny_tokenizer(),
                          sampler_config=SamplerConfig(model_dir, dtype="float32", kv_cache_memory_gb=0.1))
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.compiled_layers is True
    assert compiled_modules(policy) and compiled_modules(trainer.ref_model) == compiled_modules(policy)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    seen = check_logprobs_against_trl(trainer, tol=1e-4)
    trainer.train()
    assert trainer.state.global_step == 3
    assert True in seen and False in seen
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())

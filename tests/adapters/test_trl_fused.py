"""``polynya.adapters.trl.GRPOTrainer(..., fused_kernels=True)``: the option is checked before
TRL builds anything, and the policy and TRL's reference model come out fused (every RMSNorm and
attention; on CPU they keep HF's forward, which ``tests/core/test_fused.py`` shows)."""
from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")
from polynya.adapters.trl import GRPOTrainer
from polynya.config import SamplerConfig
from polynya.fused import fused_modules
from polynya.models import tiny_tokenizer

from .test_trl_trainer import _args, _dataset, model_dir, reward_digits  # noqa: F401 (fixture)


def test_fused_kernels_fuse_policy_and_reference(model_dir, tmp_path):  # noqa: F811
    trainer = GRPOTrainer(model_dir, reward_funcs=reward_digits, args=_args(tmp_path, beta=0.04),
                          train_dataset=_dataset(), processing_class=tiny_tokenizer(),
                          sampler_config=SamplerConfig(model_dir, dtype="float32",
                                                       kv_cache_memory_gb=0.05),
                          fused_kernels=True)
    policy = fused_modules(trainer.accelerator.unwrap_model(trainer.model))
    assert len(policy) == 1 + 5 * 2  # final norm; per layer 4 norms + the attention (RoPE)
    assert "model.layers.0.self_attn.q_norm" in policy and "model.layers.0.self_attn" in policy
    assert fused_modules(trainer.ref_model) == policy


def test_fused_kernels_must_be_a_bool(model_dir, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="fused_kernels must be a bool"):
        GRPOTrainer(model_dir, reward_funcs=reward_digits, args=_args(tmp_path),
                    train_dataset=_dataset(), processing_class=tiny_tokenizer(), fused_kernels=1)

"""``polynya.adapters.trl.GRPOTrainer(..., compile_layers=True)``: the option is checked before TRL
builds anything (a bool; not together with ``fused_kernels``), the policy and TRL's reference
model come out with compiled decoder layers, and a short GRPO run through them trains, its
log-probs and entropy equal to TRL's own implementation on every micro-batch. The compile runs
with the ``aot_eager`` backend here (graphs without code generation: seconds on 2 cores);
Inductor's numbers are checked in ``tests/core/test_compiled_layers*.py``."""
from __future__ import annotations

import functools
import types

import pytest
import torch

trl = pytest.importorskip("trl")
import polynya.adapters.trl.trainer as trl_trainer
from polynya.adapters.trl import GRPOTrainer
from polynya.compiled_layers import compile_layers, compiled_modules
from polynya.config import SamplerConfig
from polynya.models import load_model, tiny_tokenizer

from .test_trl_trainer import _args, _dataset, model_dir, reward_digits  # noqa: F401 (fixture)


def _trainer(model_dir, tmp_path, **kw):  # noqa: F811
    return GRPOTrainer(model_dir, reward_funcs=reward_digits, args=_args(tmp_path, **kw.pop("args", {})),
                       train_dataset=_dataset(), processing_class=tiny_tokenizer(),
                       sampler_config=SamplerConfig(model_dir, dtype="float32", kv_cache_memory_gb=0.05),
                       **kw)



def check_logprobs_against_trl(trainer, tol: float) -> list[bool]:
    """Test instrumentation: every ``_get_per_token_logps_and_entropies`` call of ``trainer`` is
    compared with TRL's own implementation on the same batch (log-probs, and entropy where asked;
    TRL's reference model returns none). Returns the list the calls append to (True: the
    reference model's call)."""
    inner, seen = trainer._get_per_token_logps_and_entropies, []

    def spy(model, input_ids, attention_mask, logits_to_keep, **kw):
        out = inner(model, input_ids, attention_mask, logits_to_keep, **kw)
        entropy = bool(kw.get("compute_entropy"))
        with torch.no_grad():
            ref = trl.GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, model, input_ids, attention_mask, logits_to_keep, compute_entropy=entropy)
        m = attention_mask[:, -logits_to_keep:].bool()
        torch.testing.assert_close(out[0].detach()[m], ref[0][m], atol=tol, rtol=tol)
        if entropy:
            torch.testing.assert_close(out[1].detach()[m], ref[1][m], atol=tol, rtol=tol)
        seen.append(model is trainer.ref_model)
        return out

    trainer._get_per_token_logps_and_entropies = spy
    return seen


def test_compiled_layers_train_and_equal_trl_logprobs(model_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(trl_trainer, "compile_model_layers",
                        functools.partial(compile_layers, backend="aot_eager"))
    trainer = _trainer(model_dir, tmp_path, compile_layers=True, args=dict(beta=0.04))
    policy = trainer.accelerator.unwrap_model(trainer.model)
    names = compiled_modules(policy)
    assert len(names) == policy.config.num_hidden_layers
    assert compiled_modules(trainer.ref_model) == names
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    seen = check_logprobs_against_trl(trainer, tol=1e-5)
    trainer.train()
    assert trainer.state.global_step == 3
    assert True in seen and False in seen  # the reference model's and the policy's log-probs
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())
    assert compiled_modules(policy) == names


@pytest.mark.parametrize("kw, match", [
    (dict(compile_layers=1), "compile_layers must be a bool or None"),
    (dict(compile_layers=True, fused_kernels=True), "pick one"),
    (dict(compile_layers=True, args=dict(torch_compile=True)), "torch_compile=True"),
])
def test_compile_layers_option_is_checked_first(model_dir, tmp_path, kw, match):  # noqa: F811
    with pytest.raises(ValueError, match=match):
        _trainer(model_dir, tmp_path, **kw)


def test_compile_layers_default_is_on_only_where_it_is_verified(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """``compile_layers=None`` (the default): off on the CPU (nothing compiled, the eager
    forwards); on for supported layers on CUDA (decided by ``_why_not_compiled``, checked here
    with the device lookup patched: this machine has no GPU); off with ``fused_kernels``."""
    trainer = _trainer(model_dir, tmp_path)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.compiled_layers is False and compiled_modules(policy) == []
    assert trainer._why_not_compiled([policy], False) == "not on a CUDA device"
    monkeypatch.setattr(trl_trainer, "_device", lambda model: torch.device("cuda"))
    assert trainer._why_not_compiled([policy], False) is None
    assert trainer._why_not_compiled([policy], True) == "fused_kernels is on"
    monkeypatch.setattr(trainer.args, "torch_compile", True)
    assert trainer._why_not_compiled([policy], False) == "TRL's torch_compile is on"
    monkeypatch.setattr(trainer.args, "torch_compile", False)
    gemma = load_model("tiny:gemma2", dtype="float32")
    assert "is not verified" in trainer._why_not_compiled([policy, gemma], False)
    monkeypatch.setattr(trainer, "is_deepspeed_enabled", True)
    monkeypatch.setattr(trainer, "_dist", types.SimpleNamespace(is_zero3=True))
    assert trainer._why_not_compiled([policy], False) == "DeepSpeed ZeRO-3"
    monkeypatch.setattr(trainer, "_dist", types.SimpleNamespace(is_zero3=False))
    monkeypatch.setattr(trainer.accelerator.state, "num_processes", 2)
    assert "several processes" in trainer._why_not_compiled([policy], False)

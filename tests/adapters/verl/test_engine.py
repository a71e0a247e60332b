"""The ``deepspeed`` backend on a hand-built verl batch equals plain torch (fp32).

Oracle: the same random model run per sample without ZoRRo (one full forward per sequence,
``log_softmax(logits / T)``) and verl's vanilla PPO loss written out in torch (token-mean over the
global batch, dual clip) — loss, log-probs, entropy and every gradient to 1e-5; then
``optimizer_step`` returns that gradient's norm and changes the weights. Bad batches raise a
``ValueError`` naming the problem and leave weights and gradients untouched.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from polynya.adapters.verl.batch import read_batch
from polynya.adapters.verl.engine import DeepSpeedLMEngine
from polynya.adapters.verl.settings import DeepSpeedActorConfig, DeepSpeedEngineConfig
from polynya.models import load_model
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPOptimizerConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from .verl_batches import samples, verl_batch

SEED, TEMP, CLIP, CLIP_C = 42, 0.7, 0.2, 3.0


@pytest.fixture(scope="module")
def engine():
    cfg = DeepSpeedEngineConfig(dtype="float32", zero_stage=0, zorro=True, seed=SEED, use_dynamic_bsz=True,
                                max_token_len_per_gpu=40)  # small budget: several micro-batches
    model = SimpleNamespace(path="tiny:qwen3", local_path=None, lora_rank=0, enable_gradient_checkpointing=False)
    e = DeepSpeedLMEngine(model, cfg, FSDPOptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0))
    e.initialize()
    return e


def actor_config() -> DeepSpeedActorConfig:
    return DeepSpeedActorConfig(rollout_n=3, ppo_mini_batch_size=3, use_dynamic_bsz=True, clip_ratio=CLIP,
                                clip_ratio_c=CLIP_C, loss_agg_mode="token-mean")


def reference(model, prompts, responses, temperature):
    """Per-sample full forward: [B, Rmax] log-probs and entropies (0 past each response)."""
    b, r = len(prompts), max(map(len, responses))
    lp, ent = torch.zeros(b, r), torch.zeros(b, r)
    rows_lp, rows_ent = [], []
    for i, (p, s) in enumerate(zip(prompts, responses)):
        logits = model(torch.tensor([p + s])).logits[0, len(p) - 1:len(p) + len(s) - 1] / temperature
        logp = torch.log_softmax(logits.float(), -1)
        rows_lp.append(logp.gather(-1, torch.tensor(s)[:, None])[:, 0])
        rows_ent.append(-(logp.exp() * logp).sum(-1))
    for i, (a, e) in enumerate(zip(rows_lp, rows_ent)):
        lp = lp.index_put((torch.full((len(a),), i), torch.arange(len(a))), a)
        ent = ent.index_put((torch.full((len(e),), i), torch.arange(len(e))), e)
    return lp, ent


def vanilla_ppo(lp, old, adv, mask):
    ratio = torch.exp((lp - old).clamp(-20, 20))
    clip1 = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    pg = torch.where(adv < 0, torch.minimum(-adv * CLIP_C, clip1), clip1)
    return (pg * mask).sum() / mask.sum()


def make(seed=0, **kw):
    prompts, responses, uids = samples(seed)
    ref_model = load_model("tiny:qwen3", dtype="float32", device="cpu", seed=SEED)
    with torch.no_grad():
        lp, _ = reference(ref_model, prompts, responses, TEMP)
    g = torch.Generator().manual_seed(seed + 1)
    r = lp.shape[1]
    mask = torch.arange(r)[None] < torch.tensor([len(s) for s in responses])[:, None]
    old = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask  # ratios inside and outside the clip
    adv = torch.randn(len(prompts), 1, generator=g).expand(-1, r) * mask
    data = verl_batch(prompts, responses, uids, old_log_probs=old, advantages=adv, temperature=TEMP, **kw)
    return data, (prompts, responses, old, adv, mask.float())


def grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("problem, message", [
    ("no uid", "uid"),
    ("empty", "empty"),
    ("mask past response", "masks do not match"),
    ("uid shared by two prompts", "same uid have different prompts"),
    ("jagged loss mask", "SFT"),
    ("no temperature", "temperature"),
    ("shifted positions", "position_ids"),
    ("image inputs", "multi_modal_inputs"),  # verl's engines would feed the pixels to the model
])
def test_bad_batches_raise_and_change_nothing(engine, problem, message):
    data, _ = make()
    if problem == "no uid":
        del data["uid"]
    elif problem == "empty":
        data = TensorDict({"response_mask": torch.zeros(0, 4)}, batch_size=[0])
    elif problem == "mask past response":
        data["response_mask"] = torch.ones_like(data["response_mask"])
    elif problem == "uid shared by two prompts":
        data["uid"] = tu.get(data, "uid")  # list
        tu.assign_non_tensor_stack(data, "uid", ["same"] * len(data))
    elif problem == "jagged loss mask":
        data["loss_mask"] = torch.nested.as_nested_tensor([torch.ones(4), torch.ones(3), torch.ones(2)] * 3,
                                                    layout=torch.jagged)
    elif problem == "no temperature":
        del data["temperature"]
    elif problem == "shifted positions":
        pos = data["position_ids"]
        data["position_ids"] = torch.nested.nested_tensor_from_jagged(pos.values() + 1, pos.offsets())
    elif problem == "image inputs":
        rows = [{} for _ in range(len(data))]
        rows[2] = {"pixel_values": torch.rand(4, 6), "image_grid_thw": torch.tensor([[1, 2, 2]])}
        tu.assign_non_tensor_stack(data, "multi_modal_inputs", rows)
    before = weights(engine.trainer.module)
    with pytest.raises(ValueError, match=message):
        engine.forward_backward_batch(data, partial(ppo_loss, config=actor_config()))
    assert grads(engine.trainer.module) == {}
    for n, w in weights(engine.trainer.module).items():
        assert torch.equal(w, before[n])
    engine.optimizer_zero_grad()  # nothing pending


def test_forward_backward_batch_equals_plain_torch_then_step(engine):
    data, (prompts, responses, old, adv, mask) = make(calculate_entropy=True, return_model_output=True)
    ref_model = load_model("tiny:qwen3", dtype="float32", device="cpu", seed=SEED)
    for n, w in weights(engine.trainer.module).items():  # same model on both sides
        assert torch.equal(w, dict(ref_model.named_parameters())[n].detach()), n
    lp_ref, ent_ref = reference(ref_model, prompts, responses, TEMP)
    loss_ref = vanilla_ppo(lp_ref, old, adv, mask)
    loss_ref.backward()
    g_ref = grads(ref_model)

    engine.optimizer_zero_grad()
    out = engine.forward_backward_batch(data, partial(ppo_loss, config=actor_config()))
    assert len(out["loss"]) >= 2  # several micro-batches of whole groups
    torch.testing.assert_close(torch.tensor(sum(out["loss"])), loss_ref.detach(), rtol=1e-5, atol=1e-5)
    lp = no_padding_2_padding(out["model_output"]["log_probs"], data)
    ent = no_padding_2_padding(out["model_output"]["entropy"], data)
    torch.testing.assert_close(lp * mask, lp_ref * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent * mask, ent_ref * mask, rtol=1e-5, atol=1e-5)
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss"} <= set(out["metrics"])
    g = grads(engine.trainer.module)
    assert g.keys() == g_ref.keys() and len(g) > 10
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-5, atol=1e-5, msg=n)

    before = weights(engine.trainer.module)
    norm = engine.optimizer_step()
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in g_ref.values()]))
    assert norm == pytest.approx(float(want), rel=1e-5)
    after = weights(engine.trainer.module)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert set(changed) == set(g_ref)
    engine.optimizer_zero_grad()


def test_infer_batch_gives_log_probs_without_gradients(engine):
    data, (prompts, responses, _, _, mask) = make(seed=3)
    tu.assign_non_tensor_stack(data, "multi_modal_inputs", [{} for _ in range(len(data))])  # text-only rows pass
    ref_model = load_model("tiny:qwen3", dtype="float32", device="cpu", seed=SEED)
    ref_model.load_state_dict({n: p.detach() for n, p in engine.trainer.module.named_parameters()}, strict=False)
    with torch.no_grad():
        lp_ref, _ = reference(ref_model, prompts, responses, TEMP)
    tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False)
    out = engine.infer_batch(data, loss_function=None)
    lp = no_padding_2_padding(out["model_output"]["log_probs"], data)
    torch.testing.assert_close(lp * mask, lp_ref * mask, rtol=1e-5, atol=1e-5)
    assert "entropy" not in out["model_output"] and out["loss"] == []
    assert grads(engine.trainer.module) == {}


def test_offload_follows_verls_mode_contexts_and_train_batch_runs():
    """param/optimizer offload (ZeRO-2): resident only inside verl's train/eval contexts; verl's
    own ``BaseEngine.train_batch`` (zero_grad, forward_backward_batch, optimizer_step) inside."""
    cfg = DeepSpeedEngineConfig(dtype="float32", zero_stage=2, seed=SEED, use_dynamic_bsz=True,
                                max_token_len_per_gpu=4096, param_offload=True, optimizer_offload=True)
    model = SimpleNamespace(path="tiny:qwen3", local_path=None, lora_rank=0, enable_gradient_checkpointing=False)
    engine = DeepSpeedLMEngine(model, cfg, FSDPOptimizerConfig(lr=1e-2, weight_decay=0.0))
    engine.initialize()
    rows = read_batch(make()[0]).batch
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.trainer.compute_logprobs(rows)
    data, _ = make()
    with engine.train_mode():
        out = engine.train_batch(data, partial(ppo_loss, config=actor_config()))
        engine.trainer.compute_logprobs(rows)  # resident inside
    assert out["metrics"]["grad_norm"] > 0 and len(out["loss"]) >= 1
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.trainer.compute_logprobs(rows)
    with engine.eval_mode():
        lp = engine.infer_batch(make()[0])["model_output"]["log_probs"]
    assert lp.is_nested and torch.isfinite(lp.values()).all()


def test_zero_stage_0_cannot_offload():
    cfg = DeepSpeedEngineConfig(dtype="float32", zero_stage=0, use_dynamic_bsz=True, max_token_len_per_gpu=64,
                                param_offload=True, optimizer_offload=True)
    model = SimpleNamespace(path="tiny:qwen3", local_path=None, lora_rank=0)
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        DeepSpeedLMEngine(model, cfg, FSDPOptimizerConfig(lr=1e-2))

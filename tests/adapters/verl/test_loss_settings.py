"""Every verl 0.9.1 actor loss setting polynya's ``deepspeed`` engine accepts gives verl's loss and
gradients; the ones it would compute differently are refused at config time.

Oracle: verl's own ``ppo_loss`` (``verl.workers.utils.losses``: ``get_policy_loss_fn``,
``agg_loss``, ``kl_penalty``, entropy) called once on the whole batch with log-probs and
entropies of a plain per-sample forward, ``batch_num_tokens`` / ``dp_size`` assigned as verl's
FSDP engine assigns them (what verl's engines compute for any micro-batching, since every
accepted loss is normalised by global counts). Candidate: the engine's
``forward_backward_batch`` with the same ``ppo_loss``, cut into several micro-batches of whole
prompt groups. Batch: three prompt groups, ragged responses (one of a single token), a row
whose response is masked out entirely and a row with a hole in its mask (multi-turn),
log-ratios inside the clip, past either clip, past the dual clip and past verl's +-20 clamp,
reference log-probs off by up to +-12 (low_var_kl's clamp at 10). Summed loss and every
gradient to fp32 tolerance (1e-5; the gradient's absolute tolerance scaled by its largest
entry: sums of large terms in another order). The same for verl's distillation loss
(``distillation_ppo_loss``) with its estimator modes on a teacher's per-token log-probs; its
top-k mode, which needs the student's logits inside the forward, is refused before the forward.
(Before 2026-12-07 distillation was neither checked nor refused: a top-k run failed inside
verl's loss with a KeyError.)
"""
from __future__ import annotations

import os
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import verl
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from polynya.adapters.verl.engine import DeepSpeedLMEngine
from polynya.adapters.verl.settings import DeepSpeedActorConfig, DeepSpeedEngineConfig
from polynya.models import load_model
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.trainer.distillation.losses import distillation_ppo_loss
from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPOptimizerConfig
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from .test_config import compose_verl
from .test_engine import reference
from .verl_batches import samples, verl_batch

SEED, TEMP = 42, 0.7


@pytest.fixture(scope="module")
def engine():
    cfg = DeepSpeedEngineConfig(dtype="float32", zero_stage=0, zorro=True, seed=SEED, use_dynamic_bsz=True,
                                max_token_len_per_gpu=40)  # several micro-batches
    model = SimpleNamespace(path="tiny:qwen3", local_path=None, lora_rank=0, enable_gradient_checkpointing=False)
    optim = FSDPOptimizerConfig(lr=0.0, weight_decay=0.0, clip_grad=1e9)  # lr 0: the weights stay
    e = DeepSpeedLMEngine(model, cfg, optim)
    e.initialize()
    return e


@pytest.fixture(scope="module")
def ref_model():
    return load_model("tiny:qwen3", dtype="float32", device="cpu", seed=SEED)


def actor(**kw) -> DeepSpeedActorConfig:
    loss = kw.pop("policy_loss", {})
    return DeepSpeedActorConfig(rollout_n=3, ppo_mini_batch_size=3, use_dynamic_bsz=True,
                                policy_loss=PolicyLossConfig(**loss), **kw)


def jagged(values: torch.Tensor, prompts, responses) -> torch.Tensor:
    """verl's no-padding model output: per sample ``P - 1`` zeros, the response's values, one 0."""
    rows = [torch.cat([values.new_zeros(len(p) - 1), values[i, :len(r)], values.new_zeros(1)])
            for i, (p, r) in enumerate(zip(prompts, responses))]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def batch_samples(seed: int):
    """``samples`` with one response cut to a single token."""
    prompts, responses, uids = samples(seed)
    responses[1] = responses[1][:1]
    return prompts, responses, uids


def make(lp: torch.Tensor, seed: int, **meta):
    """The verl batch, with old / reference log-probs placed relative to the current ``lp``."""
    prompts, responses, uids = batch_samples(seed)
    b, r = len(prompts), max(map(len, responses))
    lens = torch.tensor([len(s) for s in responses])
    mask = (torch.arange(r)[None] < lens[:, None]).long()
    mask[4] = 0  # masked out entirely
    hole = int(lens.argmax())
    mask[hole, 1:3] = 0  # a hole (tool tokens of a multi-turn response)
    g = torch.Generator().manual_seed(seed + 1)
    adv = (torch.randn(b, 1, generator=g) + 0.3 * torch.randn(b, r, generator=g)) * mask  # per token
    # log(ratio) = lp - old: near 0 (inside and just outside the clip), +-3.5 (past the dual clip
    # c=3 where A < 0), +-25 (past verl's +-20 clamp, on the side where the clip holds the term
    # constant, so no term of e^20 swamps the others)
    u = torch.rand(b, r, generator=g)
    near = (torch.rand(b, r, generator=g) - 0.5) * 0.6
    mid = 3.5 * torch.sign(torch.randn(b, r, generator=g))
    out = 25.0 * torch.sign(adv)
    lp = lp[:, :r]
    old = (lp - torch.where(u < 0.6, near, torch.where(u < 0.85, mid, out))) * mask
    ref = (lp + (torch.rand(b, r, generator=g) - 0.5) * 24.0) * mask
    is_w = torch.rand(b, r, generator=g) * 2.0 * mask
    data = verl_batch(prompts, responses, uids, old_log_probs=old, advantages=adv, temperature=TEMP,
                      response_mask=mask, **meta)
    data["ref_log_prob"] = ref
    return data, is_w, (prompts, responses)


CASES = {
    # loss_agg_mode x vanilla PPO (dual clip, asymmetric clip range)
    "token-mean": dict(loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "token-sum": dict(loss_agg_mode="token-sum", clip_ratio=0.1),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-mean": dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_c=10.0),
    "seq-mean-token-sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm"),
    "seq-mean-token-sum-norm-factor": dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=13),
    # policy_loss.loss_mode
    "gspo": dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                 policy_loss=dict(loss_mode="gspo")),
    "sapo": dict(policy_loss=dict(loss_mode="sapo"), tau_pos=1.5, tau_neg=2.0),
    "gpg": dict(loss_agg_mode="seq-mean-token-sum", policy_loss=dict(loss_mode="gpg")),
    "dppo_tv": dict(policy_loss=dict(loss_mode="dppo_tv")),
    "dppo_kl": dict(loss_agg_mode="seq-mean-token-mean", policy_loss=dict(loss_mode="dppo_kl")),
    "dro": dict(policy_loss=dict(loss_mode="dro", dro_beta=0.3)),
    "cispo": dict(clip_ratio_low=0.5, clip_ratio_high=2.0, policy_loss=dict(loss_mode="cispo")),
    "bypass-ppo-clip": dict(policy_loss=dict(loss_mode="bypass_mode", rollout_correction=dict(
        loss_type="ppo_clip", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"))),
    "bypass-reinforce": dict(loss_agg_mode="seq-mean-token-sum", policy_loss=dict(
        loss_mode="bypass_mode", rollout_correction=dict(loss_type="reinforce", rollout_is="token",
                                                          rollout_is_threshold=2.0))),
    # rollout correction weights computed by the trainer (decoupled mode)
    "rollout-is-weights": dict(_is_weights=True),
    # entropy bonus
    "entropy": dict(entropy_coeff=0.01, loss_agg_mode="seq-mean-token-mean"),
    # KL loss, every kl_loss_type of verl 0.9.1 (and its straight-through "+" forms)
    **{f"kl-{t}": dict(use_kl_loss=True, kl_loss_type=t, kl_loss_coef=0.1,
                       loss_agg_mode="token-mean" if i % 2 else "seq-mean-token-mean")
       for i, t in enumerate(("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+",
                              "low_var_kl+", "k3+"))},
}


def grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def teacher_logprobs(lp: torch.Tensor, prompts, responses, seed: int):
    """A teacher's per-token log-probs in verl's no-padding layout (``[P + R, 1]`` per sample,
    as verl's teacher servers fill ``teacher_logprobs`` for the estimator losses)."""
    g = torch.Generator().manual_seed(seed + 7)
    t = (lp - torch.rand(lp.shape, generator=g) * 3.0).clamp(max=0.0)
    rows = [torch.cat([t.new_zeros(len(p) - 1), t[i, :len(r)], t.new_zeros(1)])[:, None]
            for i, (p, r) in enumerate(zip(prompts, responses))]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def assert_engine_equals_verl(engine, ref_model, kw: dict, loss_fn) -> None:
    """Oracle: ``loss_fn`` (verl's) on the whole batch with a plain per-sample forward;
    candidate: the engine's ``forward_backward_batch`` with the same function, several
    micro-batches. Loss sum and every gradient equal (module docstring)."""
    kw = dict(kw)
    use_is = kw.pop("_is_weights", False)
    config = actor(**kw)
    entropy = config.entropy_coeff != 0
    with torch.no_grad():
        lp0, _ = reference(ref_model, *batch_samples(0)[:2], TEMP)

    def batch():
        data, is_w, (prompts, responses) = make(lp0, 0, calculate_entropy=entropy)
        if use_is:
            data["rollout_is_weights"] = is_w
        data["teacher_logprobs"] = teacher_logprobs(lp0, prompts, responses, 0)
        return data, prompts, responses

    data, prompts, responses = batch()
    ref_model.zero_grad(set_to_none=True)
    lp, ent = reference(ref_model, prompts, responses, TEMP)
    out = {"log_probs": jagged(lp, prompts, responses)}
    if entropy:
        out["entropy"] = jagged(ent, prompts, responses)
    tu.assign_non_tensor(data, batch_num_tokens=int(data["loss_mask"].sum()), dp_size=1)  # as verl's FSDP
    want, _ = loss_fn(actor(**kw))(model_output=out, data=data)
    want.backward()
    want_grads = grads(ref_model)

    data, _, _ = batch()
    engine.optimizer_zero_grad()
    got = engine.forward_backward_batch(data, loss_fn(config))
    got_grads = grads(engine.trainer.module)
    engine.optimizer_step()  # lr 0: clears the accumulation, weights unchanged
    engine.optimizer_zero_grad()

    assert len(got["loss"]) >= 2
    torch.testing.assert_close(torch.tensor(sum(got["loss"])), want.detach(), rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for n, g in want_grads.items():
        atol = 1e-6 * max(1.0, float(g.abs().max()))  # fp32 sums of large terms, in another order
        torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
    assert any(g.abs().sum() > 0 for g in got_grads.values())


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_equal_verls_own(engine, ref_model, name):
    assert_engine_equals_verl(engine, ref_model, CASES[name], lambda config: partial(ppo_loss, config=config))


# verl's distillation (distillation.enabled): the estimator losses on the student's log-probs,
# as a supervised term beside the task's policy loss or as a reward of the policy gradient
DISTILL_CASES = {
    "k3-supervised-with-task": dict(loss_mode="k3", use_policy_gradient=False, use_task_rewards=True,
                                    distillation_loss_coef=0.5),
    "k1-policy-gradient": dict(loss_mode="k1", use_policy_gradient=True, use_task_rewards=False),
    "low_var_kl-only": dict(loss_mode="low_var_kl", use_policy_gradient=False, use_task_rewards=False,
                            loss_max_clamp=2.0),
    "k2-pg-with-task": dict(loss_mode="k2", use_policy_gradient=True, use_task_rewards=True),
}


def distillation(**loss) -> DistillationConfig:
    return DistillationConfig(distillation_loss=DistillationLossConfig(**loss))  # (enabled: teachers)


@pytest.mark.parametrize("name", list(DISTILL_CASES))
def test_distillation_estimator_losses_equal_verls_own(engine, ref_model, name):
    dist = distillation(**DISTILL_CASES[name])
    assert_engine_equals_verl(engine, ref_model, CASES["token-mean"], lambda config: partial(
        distillation_ppo_loss, config=config, distillation_config=dist))


def test_top_k_distillation_is_refused_before_the_forward(engine):
    """``forward_kl_topk`` needs the student's logits inside the forward (verl's logits
    processor): refused with the weights and gradients untouched."""
    dist = distillation(loss_mode="forward_kl_topk")
    with torch.no_grad():
        lp0, _ = reference(load_model("tiny:qwen3", dtype="float32", device="cpu", seed=SEED),
                           *batch_samples(0)[:2], TEMP)
    data, _, _ = make(lp0, 0)
    before = {n: p.detach().clone() for n, p in engine.trainer.module.named_parameters()}
    engine.optimizer_zero_grad()
    with pytest.raises(ValueError, match="loss_mode='forward_kl_topk'.*estimator"):
        engine.forward_backward_batch(data, partial(distillation_ppo_loss, config=actor(),
                                                    distillation_config=dist))
    assert all(p.grad is None or not p.grad.any() for p in engine.trainer.module.parameters())
    assert all(torch.equal(p, before[n]) for n, p in engine.trainer.module.named_parameters())


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "loss_mode='clip_cov'"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", "loss_mode='kl_cov'"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean", "loss_mode='geo_mean'"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=my_custom_loss", "loss_mode='my_custom_loss'"),
    ("actor_rollout_ref.actor.calculate_sum_pi_squared=true", "calculate_sum_pi_squared"),
])
def test_loss_settings_computed_per_micro_batch_are_refused(override, message):
    cfg = compose_verl(override)
    with pytest.raises((ValueError, InstantiationException), match=message):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_bypass_mode_with_batch_normalised_weights_is_refused():
    with pytest.raises(ValueError, match="rollout_is_batch_normalize"):
        actor(policy_loss=dict(loss_mode="bypass_mode", rollout_correction=dict(rollout_is_batch_normalize=True)))
    actor(policy_loss=dict(loss_mode="bypass_mode"))  # without it: accepted


def test_unset_loss_settings_keep_verls_defaults():
    """The swap changes no loss default of verl's actor.yaml."""
    cfg = compose_verl()
    ours = cfg.actor_rollout_ref.actor
    keys = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "loss_scale_factor",
            "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "tau_pos", "tau_neg", "ppo_epochs",
            "calculate_entropy", "policy_loss")
    conf = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=conf, version_base=None):
        stock = compose("ppo_trainer").actor_rollout_ref.actor
    for k in keys:
        assert ours[k] == stock[k], k

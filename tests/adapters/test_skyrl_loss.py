"""polynya's loss under ``train_config_from_skyrl`` equals SkyRL 0.4.0's policy-worker loss (runs in
the main environment: SkyRL itself needs CPython >= 3.12, so its loss code is transcribed below
from the ``skyrl==0.4.0`` wheel, file and function named at each piece).

SkyRL's worker (``PolicyWorkerBase.forward_backward`` / ``_forward_backward_micro``,
``backends/skyrl_train/workers/worker.py``) sums ``ppo_policy_loss`` over loss-mask tokens with
advantages its trainer pre-scaled, times ``dp_size`` (DP gradient averaging undoes it), and adds
``kl_loss_coef`` x the mean over the micro-batch's rows of each row's masked-mean KL, times
``len(micro_batch) / len(data)``. Candidate: ``polynya.losses.policy_loss`` with the mapped
``LossConfig`` on the batch ``rollout_from_training_batch`` reads, cut into two micro-batches
with the global ``Normalizer`` as the training engine does. Random ragged batches in SkyRL's
right-aligned layout: a one-token response, a row whose loss mask is all zero (no KL: SkyRL's
multi-turn masks), log-ratios inside / past both clips and past SkyRL's +-20 clamp, reference
log-probs past k3's clamps (10 on the estimate, 20 on the exponent) and past 20 for k1 / k2.
Summed loss and gradient w.r.t. the log-probs, fp32 tolerance.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from polynya.adapters.skyrl import rollout_from_training_batch, train_config_from_skyrl
from polynya.adapters.skyrl.batch import from_right_aligned
from polynya.losses import Normalizer, policy_loss, resolve_loss


# ---------------------------------------------------------------- SkyRL 0.4.0, transcribed
def safe_exp_delta(delta, clip=20.0, out_dtype=None):  # backends/skyrl_train/utils/torch_utils.py
    y = torch.clamp(delta.to(torch.float32), -clip, clip).exp()
    return y.to(out_dtype or delta.dtype)


def masked_mean(tensor, mask, dim=None):  # backends/skyrl_train/utils/torch_utils.py
    if mask is None:
        return tensor.mean(axis=dim)
    return (tensor * mask).sum(axis=dim) / mask.sum(axis=dim).clamp(min=1.0)


def compute_approx_kl(log_probs, log_probs_base, loss_mask=None, kl_estimator_type="k3"):  # utils/ppo_utils.py
    if kl_estimator_type == "k1":
        kld = log_probs - log_probs_base
    elif kl_estimator_type == "abs":
        kld = (log_probs - log_probs_base).abs()
    elif kl_estimator_type == "k2":
        kld = 0.5 * (log_probs - log_probs_base).square()
    elif kl_estimator_type == "k3":
        kl = log_probs_base - log_probs
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        kld = torch.clamp(kld, min=-10, max=10)
    else:
        raise ValueError(f"Invalid KL estimator type: {kl_estimator_type}")
    if loss_mask is not None:
        kld = torch.where(loss_mask.bool(), kld * loss_mask, 0.0)
    return kld


def ppo_policy_loss(log_probs, old_log_probs, advantages, algo, loss_mask):  # utils/ppo_utils.py ("regular")
    ratio = safe_exp_delta(log_probs - old_log_probs, clip=20.0, out_dtype=log_probs.dtype)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - algo["eps_clip_low"], 1 + algo["eps_clip_high"]) * advantages
    loss = -torch.min(surr1, surr2)
    return (loss * loss_mask).sum()  # reduce_loss


def skyrl_worker_loss(lp, data, algo, micro_batch_size, dp_size=1):
    """Sum over micro-batches of ``_forward_backward_micro``'s loss (RL path), divided by
    ``dp_size`` as the DP gradient average does."""
    n, total = lp.shape[0], 0.0
    for s in range(0, n, micro_batch_size):
        rows = slice(s, min(s + micro_batch_size, n))
        weight = (rows.stop - rows.start) / n
        mask = data["loss_mask"][rows]
        pg = ppo_policy_loss(lp[rows], data["action_log_probs"][rows], data["advantages"][rows], algo, mask)
        kl = torch.tensor(0.0)
        if algo["use_kl_loss"]:
            kl = compute_approx_kl(lp[rows], data["base_action_log_probs"][rows], loss_mask=mask,
                                   kl_estimator_type=algo["kl_estimator_type"])
            kl = masked_mean(kl, mask, dim=-1).mean()
        total = total + (pg * dp_size + kl * algo["kl_loss_coef"] * weight) / dp_size
    return total


# ---------------------------------------------------------------- SkyRL 0.4.0 AlgorithmConfig defaults
SKYRL_DEFAULTS = dict(policy_loss_type="regular", eps_clip_low=0.2, eps_clip_high=0.2, use_kl_loss=True,
                      kl_loss_coef=0.001, kl_estimator_type="k3", use_entropy_loss=False, use_tis=False,
                      enable_sample_support_replay=False)  # skyrl/train/config/config.py, AlgorithmConfig


def skyrl_batch(seed: int, multi_turn: bool):
    """SkyRL's layout: left-padded ``[pad, prompt, response]`` rows, right-aligned per-token tensors."""
    g = torch.Generator().manual_seed(seed)
    resp = [1, 5, 3, 7, 2, 6, 4, 7]
    prompt = [4, 4, 4, 4, 3, 3, 3, 3]
    b, r = len(resp), max(resp)
    t = max(p + n for p, n in zip(prompt, resp))
    seqs = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    rmask = torch.zeros(b, r)
    for i, (p, n) in enumerate(zip(prompt, resp)):
        seqs[i, t - p - n:] = torch.randint(3, 500, (p + n,), generator=g)
        if i % 4:  # GRPO groups share their prompt
            seqs[i, t - p - n:t - n] = seqs[i - 1, t - p - resp[i - 1]:t - resp[i - 1]]
        attn[i, t - p - n:] = 1
        rmask[i, r - n:] = 1
    lmask = rmask.clone()
    if multi_turn:
        lmask[3, -5:-3] = 0  # observation tokens inside a response
        lmask[5] = 0  # a response trained on nothing
    lp = torch.log(torch.rand(b, r, generator=g)) * 3 * rmask  # the current policy's log-probs
    u = torch.rand(b, r, generator=g)
    scores = torch.randn(b, 1, generator=g)
    adv = scores / lmask.sum().clamp(min=1) * rmask  # token_mean pre-scaling of the mini-batch
    # log(ratio): near 0 (inside / just past the clips), +-3, +-25 (past SkyRL's +-20 clamp)
    sign = torch.sign(torch.randn(b, r, generator=g))
    log_ratio = torch.where(u < 0.5, (torch.rand(b, r, generator=g) - 0.5) * 0.8,
                            torch.where(u < 0.8, 3.0 * sign, 25.0 * sign))
    old = (lp - log_ratio) * rmask
    d = (torch.rand(b, r, generator=g) - 0.5) * 60.0  # ref - lp up to +-30: past every clamp
    ref = (lp + d) * rmask
    data = {"sequences": seqs, "attention_mask": attn, "response_mask": rmask, "loss_mask": lmask,
            "advantages": adv, "action_log_probs": old, "base_action_log_probs": ref}
    return data, lp


def polynya_loss(lp_right, data, algo, micro_batches: int = 2):
    cfg = train_config_from_skyrl({"algorithm": algo}, "tiny:qwen3")
    spec = resolve_loss(cfg.loss, cfg.loss_config)
    kl_on = spec.kl_coef > 0
    batch = rollout_from_training_batch(data, with_advantages=True, with_ref=kl_on)
    lens = data["response_mask"].sum(-1).long()
    lp = from_right_aligned(lp_right, lens)
    mask = batch.response_mask()
    normalizer = Normalizer.from_mask(mask, spec.max_response_len)
    b, total = lp.shape[0], 0.0
    cuts = torch.linspace(0, b, micro_batches + 1).long().tolist()
    for lo, hi in itertools.pairwise(cuts):
        rows = slice(lo, hi)
        out = policy_loss(spec, lp[rows], batch.advantages[rows], mask[rows], normalizer,
                          old_logprobs=batch.old_logprobs[rows],
                          ref_logprobs=batch.ref_logprobs[rows] if kl_on else None)
        total = total + out.loss
    return total


CASES = {
    "pg-only": dict(use_kl_loss=False),
    "pg-only-multi-turn": dict(use_kl_loss=False, _multi_turn=True),
    "k3": dict(kl_estimator_type="k3", kl_loss_coef=0.05, eps_clip_high=0.28),
    "k2": dict(kl_estimator_type="k2", kl_loss_coef=0.01),
    "k1": dict(kl_estimator_type="k1", kl_loss_coef=0.1, eps_clip_low=0.1, eps_clip_high=0.3),
    "defaults": dict(),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_equal_skyrl_worker(name, seed):
    case = dict(CASES[name])
    multi_turn = case.pop("_multi_turn", False)
    algo = {**SKYRL_DEFAULTS, "temperature": 1.0, **case}
    data, lp0 = skyrl_batch(seed, multi_turn)
    lp_theirs = lp0.clone().requires_grad_(True)
    want = skyrl_worker_loss(lp_theirs, data, algo, micro_batch_size=3)
    want.backward()
    lp_ours = lp0.clone().requires_grad_(True)
    got = polynya_loss(lp_ours, data, {k: v for k, v in algo.items() if k in case or k == "temperature"})
    got.backward()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp_ours.grad, lp_theirs.grad, rtol=1e-5, atol=1e-7)
    assert lp_theirs.grad.abs().sum() > 0


def test_clamps_and_defaults_are_skyrls():
    """Unset keys take SkyRL's defaults; SkyRL's clamps come along (log-ratio 20; k3 only: 10)."""
    cfg = train_config_from_skyrl({"algorithm": {"temperature": 0.7}}, "tiny:qwen3")
    lc = cfg.loss_config
    assert (cfg.loss, lc.clip_low, lc.clip_high, lc.kl_coef, lc.kl_estimator) == ("ppo", 0.2, 0.2, 0.001, "k3")
    assert (lc.norm, lc.kl_norm, lc.log_ratio_clip, lc.kl_clip) == ("sum", "sequence", 20.0, 10.0)
    for est in ("k1", "k2"):
        lc = train_config_from_skyrl({"algorithm": {"temperature": 0.7, "kl_estimator_type": est}},
                                     "tiny:qwen3").loss_config
        assert lc.kl_estimator == est and lc.kl_clip is None and lc.log_ratio_clip == 20.0


@pytest.mark.parametrize("algo, key", [
    (dict(policy_loss_type="dual_clip"), "policy_loss_type"),
    (dict(policy_loss_type="gspo"), "policy_loss_type"),
    (dict(kl_estimator_type="abs"), "kl_estimator_type"),
    (dict(use_entropy_loss=True), "use_entropy_loss"),
    (dict(use_tis=True), "use_tis"),
])
def test_settings_skyrl_computes_otherwise_are_refused(algo, key):
    with pytest.raises(ValueError, match=key):
        train_config_from_skyrl({"algorithm": {"temperature": 1.0, **algo}}, "tiny:qwen3")

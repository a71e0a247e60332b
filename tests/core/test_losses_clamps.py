"""``LossConfig.log_ratio_clip`` / ``kl_clip`` and the KL estimators' clamps (``polynya.losses``),
against hand-written torch on random ragged batches: values and gradients w.r.t. the log-probs,
including the regions past each clamp (no gradient there) and masked positions holding inf."""
from __future__ import annotations

import math

import pytest
import torch
from polynya.config.train import LossConfig
from polynya.losses import Normalizer, kl_penalty, policy_loss, resolve_loss


def batch(seed: int, b: int = 5, r: int = 7):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([1, r, 3, 0, 5])[:b]  # one token, full, ragged, none
    mask = torch.arange(r)[None] < lens[:, None]
    logp = (torch.log(torch.rand(b, r, generator=g)) * 2).requires_grad_(True)
    far = 30.0 * torch.sign(torch.randn(b, r, generator=g))
    near = torch.randn(b, r, generator=g)
    pick = torch.rand(b, r, generator=g) < 0.4
    old = logp.detach() - torch.where(pick, far, near)
    ref = logp.detach() + torch.where(~pick, far, near)
    adv = torch.randn(b, r, generator=g)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [None, 20.0, 2.5])
def test_log_ratio_clip_is_a_clamp_before_exp(seed, clip):
    logp, old, _, adv, mask = batch(seed)
    spec = resolve_loss("ppo", LossConfig(norm="sum", log_ratio_clip=clip))
    out = policy_loss(spec, logp, adv, mask, Normalizer.from_mask(mask), old_logprobs=old)
    out.loss.backward()
    lp = logp.detach().clone().requires_grad_(True)
    lr = lp - old
    ratio = torch.exp(lr if clip is None else lr.clamp(-clip, clip))
    want = (torch.maximum(-ratio * adv, -ratio.clamp(0.8, 1.2) * adv) * mask).sum()
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.grad, lp.grad, rtol=1e-5, atol=1e-6)
    if clip is not None:  # no gradient where the log-ratio is past the clamp
        assert (logp.grad[mask & ((logp.detach() - old).abs() > clip)] == 0).all()


def test_log_ratio_clip_on_the_sequence_ratio():
    logp, old, _, adv, mask = batch(3)
    spec = resolve_loss("gspo", LossConfig(norm="sum", clip_low=0.5, clip_high=0.5, log_ratio_clip=1.0))
    out = policy_loss(spec, logp, adv, mask, Normalizer.from_mask(mask), old_logprobs=old)
    out.loss.backward()
    lp = logp.detach().clone().requires_grad_(True)
    m = mask.float()
    seq = ((lp.detach() - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    ratio = torch.exp((seq + lp - lp.detach()).clamp(-1.0, 1.0))
    want = (torch.maximum(-ratio * adv, -ratio.clamp(0.5, 1.5) * adv) * m).sum()
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.grad, lp.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("kl_clip", [None, 10.0])
def test_kl_estimators_and_kl_clip(estimator, kl_clip):
    """k1 / k2 are unclamped (as verl's and SkyRL's); k3's exponent is clamped to +-20 (as
    theirs); ``kl_clip`` clamps the estimate itself."""
    logp, _, ref, adv, mask = batch(4)
    spec = resolve_loss("ppo", LossConfig(norm="sum", kl_norm="sum", kl_coef=0.5, kl_estimator=estimator,
                                          kl_clip=kl_clip))
    out = policy_loss(spec, logp, adv * 0, mask, Normalizer.from_mask(mask), ref_logprobs=ref)
    out.loss.backward()
    lp = logp.detach().clone().requires_grad_(True)
    d = ref - lp
    raw = {"k1": -d, "k2": 0.5 * d ** 2, "k3": torch.exp(d.clamp(-20, 20)) - d.clamp(-20, 20) - 1}[estimator]
    torch.testing.assert_close(kl_penalty(logp.detach(), ref, estimator)[mask], raw.detach()[mask],
                               rtol=1e-5, atol=1e-5)
    kl = raw if kl_clip is None else raw.clamp(-kl_clip, kl_clip)
    want = 0.5 * (kl * mask).sum()
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp.grad, lp.grad, rtol=1e-5, atol=1e-5)
    assert (d.abs()[mask] > 20).any()  # the batch does reach past 20


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_masked_positions_holding_inf_give_finite_gradients(estimator):
    logp, old, ref, adv, mask = batch(5)
    ref = torch.where(mask, ref, torch.full_like(ref, -math.inf))
    old = torch.where(mask, old, torch.full_like(old, -math.inf))
    spec = resolve_loss("grpo", LossConfig(kl_coef=0.1, kl_estimator=estimator))
    out = policy_loss(spec, logp, adv, mask, Normalizer.from_mask(mask), old_logprobs=old, ref_logprobs=ref)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all()


@pytest.mark.parametrize("field", ["log_ratio_clip", "kl_clip"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "20"])
def test_clip_settings_are_checked(field, bad):
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: bad})

"""polynya.losses against hand-written formulas, and split-invariance of every normalisation."""
from __future__ import annotations

import pytest
import torch
from polynya.config.train import LOSSES, LossConfig, OptimConfig, TrainConfig
from polynya.losses import Normalizer, kl_penalty, policy_loss, resolve_loss


def inputs(seed: int, b: int = 7, r: int = 9, per_token: bool = False):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, r + 1, (b,), generator=g)
    lens[0] = r
    mask = torch.arange(r)[None] < lens[:, None]
    logp = (-torch.rand(b, r, generator=g) * 3).requires_grad_()
    old = torch.where(mask, logp.detach() + 0.3 * torch.randn(b, r, generator=g), torch.zeros(()))
    ref = torch.where(mask, logp.detach() + 0.2 * torch.randn(b, r, generator=g), torch.zeros(()))
    ent = torch.rand(b, r, generator=g) * 2
    adv = torch.randn((b, r) if per_token else (b,), generator=g)
    return logp, old, ref, ent, adv, mask


def loss_and_grad(spec, logp, adv, mask, norm, **kw):
    out = policy_loss(spec, logp, adv, mask, norm, **kw)
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("per_token", [False, True])
def test_split_invariance(name, per_token):
    """Sum of micro-batch losses / gradients == whole-batch loss / gradient, any split."""
    logp, old, ref, ent, adv, mask = inputs(1, per_token=per_token)
    spec = resolve_loss(name, LossConfig(kl_coef=0.05, entropy_coef=0.01))
    norm = Normalizer.from_mask(mask)
    full, g_full = loss_and_grad(spec, logp, adv, mask, norm, old_logprobs=old, ref_logprobs=ref, entropy=ent)
    total, g_parts = 0.0, torch.zeros_like(logp)
    metrics = {k: 0.0 for k in full.metrics}
    for rows in ([0, 3], [1], [2, 4, 5, 6]):
        r = torch.tensor(rows)
        part = logp.detach()[r].requires_grad_()
        out, g = loss_and_grad(spec, part, adv[r], mask[r], norm, old_logprobs=old[r],
                               ref_logprobs=ref[r], entropy=ent[r])
        total += float(out.loss.detach())
        g_parts[r] = g
        for k in metrics:
            metrics[k] += float(out.metrics[k])
    assert total == pytest.approx(float(full.loss.detach()), rel=1e-6, abs=1e-8)
    torch.testing.assert_close(g_parts, g_full, rtol=1e-6, atol=1e-9)
    for k, v in metrics.items():
        assert v == pytest.approx(float(full.metrics[k]), rel=1e-6, abs=1e-8), k


def reference_token_losses(logp, old, adv, mask, low, high):
    ratio = torch.exp(logp - old)
    a = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    return torch.maximum(-ratio * a, -ratio.clamp(1 - low, 1 + high) * a) * mask


def test_ppo_dapo_grpo_drgrpo_formulas():
    logp, old, _, _, adv, mask = inputs(2)
    m = mask.float()
    lens, n_seq, n_tok = m.sum(-1), mask.shape[0], m.sum()
    norm = Normalizer.from_mask(mask)
    expect = {
        "ppo": reference_token_losses(logp, old, adv, m, 0.2, 0.2).sum() / n_tok,
        "dapo": reference_token_losses(logp, old, adv, m, 0.2, 0.28).sum() / n_tok,
        "grpo": (reference_token_losses(logp, old, adv, m, 0.2, 0.2).sum(-1) / lens).sum() / n_seq,
        "dr_grpo": reference_token_losses(logp, old, adv, m, 0.2, 0.2).sum() / (n_seq * mask.shape[1]),
    }
    for name, want in expect.items():
        out, g = loss_and_grad(resolve_loss(name), logp, adv, mask, norm, old_logprobs=old)
        (g_want,) = torch.autograd.grad(want, logp)
        assert float(out.loss) == pytest.approx(float(want), rel=1e-6), name
        torch.testing.assert_close(g, g_want, rtol=1e-5, atol=1e-8)
        assert float(out.metrics["pg_loss"]) == pytest.approx(float(want), rel=1e-6)


def test_sum_norm_with_sequence_kl_formula():
    """norm="sum" (pre-scaled advantages) with kl_norm="sequence": SkyRL's PPO loss layout."""
    logp, old, ref, _, adv, mask = inputs(5, per_token=True)
    spec = resolve_loss("ppo", LossConfig(norm="sum", kl_norm="sequence", kl_coef=0.1,
                                          clip_low=0.2, clip_high=0.28))
    out, grad = loss_and_grad(spec, logp, adv, mask, Normalizer.from_mask(mask),
                              old_logprobs=old, ref_logprobs=ref)
    x = logp.detach().clone().requires_grad_()
    m = mask.float()
    r = torch.exp(x - old)
    pg = torch.maximum(-r * adv, -r.clamp(0.8, 1.28) * adv)
    d = ref - x
    kl = torch.exp(d) - 1 - d
    want = (pg * m).sum() + 0.1 * ((kl * m).sum(-1) / m.sum(-1)).mean()
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(grad, x.grad, rtol=1e-6, atol=1e-7)


def test_kl_norm_defaults_to_norm_and_is_checked():
    assert resolve_loss("grpo").kl_norm == "sequence"
    assert resolve_loss("ppo", LossConfig(norm="sum")).kl_norm == "sum"
    with pytest.raises(ValueError, match="kl_norm must be one of"):
        LossConfig(kl_norm="tokens")


def test_dapo_clips_higher_than_grpo():
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = torch.tensor([[0.25]]).log().requires_grad_()
    old = torch.tensor([[0.2]]).log()  # ratio 1.25: inside DAPO's 1.28, outside GRPO's 1.2
    adv = torch.tensor([1.0])
    norm = Normalizer.from_mask(mask)
    dapo, g_dapo = loss_and_grad(resolve_loss("dapo"), logp, adv, mask, norm, old_logprobs=old)
    grpo, g_grpo = loss_and_grad(resolve_loss("grpo"), logp, adv, mask, norm, old_logprobs=old)
    assert float(dapo.loss) == pytest.approx(-1.25) and float(g_dapo) != 0
    assert float(grpo.loss) == pytest.approx(-1.2) and float(g_grpo) == 0
    assert float(grpo.metrics["clip_frac"]) == 1.0 and float(dapo.metrics["clip_frac"]) == 0.0


def test_gspo_sequence_ratio():
    logp, old, _, _, adv, mask = inputs(3)
    spec = resolve_loss("gspo", LossConfig(clip_low=0.5, clip_high=0.5))
    out, g = loss_and_grad(spec, logp, adv, mask, Normalizer.from_mask(mask), old_logprobs=old)
    m = mask.float()
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))  # GSPO's sequence ratio
    want = torch.maximum(-s * adv, -s.clamp(0.5, 1.5) * adv).mean()
    (g_want,) = torch.autograd.grad(want, logp)
    assert float(out.loss) == pytest.approx(float(want), rel=1e-6)
    torch.testing.assert_close(g, g_want, rtol=1e-5, atol=1e-8)


def test_kl_estimators_and_entropy_bonus():
    logp, _, ref, ent, adv, mask = inputs(4)
    d = ref - logp.detach()
    torch.testing.assert_close(kl_penalty(logp.detach(), ref, "k1"), -d)
    torch.testing.assert_close(kl_penalty(logp.detach(), ref, "k2"), 0.5 * d ** 2)
    torch.testing.assert_close(kl_penalty(logp.detach(), ref, "k3"), d.exp() - 1 - d)
    assert (kl_penalty(logp.detach(), ref, "k3") >= 0).all()
    norm = Normalizer.from_mask(mask)
    base = policy_loss(resolve_loss("ppo"), logp, adv, mask, norm)
    m = mask.float()
    for est in ("k1", "k2", "k3"):
        spec = resolve_loss("ppo", LossConfig(kl_coef=0.1, kl_estimator=est, entropy_coef=0.01))
        out = policy_loss(spec, logp, adv, mask, norm, ref_logprobs=ref, entropy=ent)
        kl = (kl_penalty(logp.detach(), ref, est) * m).sum() / m.sum()
        h = (ent * m).sum() / m.sum()
        assert float(out.loss) == pytest.approx(float(base.loss) + 0.1 * float(kl) - 0.01 * float(h), rel=1e-5)
        assert float(out.metrics["kl"]) == pytest.approx(float(kl), rel=1e-6)
        assert float(out.metrics["entropy"]) == pytest.approx(float(h), rel=1e-6)


def test_on_policy_ratio_is_one():
    logp, _, _, _, adv, mask = inputs(5)
    out = policy_loss(resolve_loss("grpo"), logp, adv, mask, Normalizer.from_mask(mask))
    assert float(out.metrics["ratio"]) == pytest.approx(1.0)
    assert float(out.loss) == pytest.approx(float(-adv.mean()), rel=1e-6)


def test_bad_inputs():
    logp, old, _, _, adv, mask = inputs(6)
    norm = Normalizer.from_mask(mask)
    with pytest.raises(ValueError):
        resolve_loss("reinforce")
    with pytest.raises(ValueError):
        policy_loss(resolve_loss("ppo"), logp, adv[:-1], mask, norm)
    with pytest.raises(ValueError):
        policy_loss(resolve_loss("ppo"), logp, adv, mask, norm, old_logprobs=old[:, :-1])
    with pytest.raises(ValueError):
        policy_loss(resolve_loss("ppo", LossConfig(kl_coef=0.1)), logp, adv, mask, norm)
    with pytest.raises(ValueError):
        Normalizer.from_mask(torch.zeros(2, 3, dtype=torch.bool))


@pytest.mark.parametrize("bad", [dict(loss="ppo2"), dict(zero_stage=4), dict(dtype="float16"), dict(lr=-1.0),
                                 dict(micro_batch_tokens=0), dict(zorro="yes"), dict(deepspeed=[1]),
                                 dict(optim=OptimConfig(schedule="warmup_cosine", total_steps=10)) | {"lr": 1.0}])
def test_train_config_validation(bad):
    if "optim" in bad:  # a valid cosine schedule: must not raise
        TrainConfig("tiny:qwen3", **bad)
        return
    with pytest.raises(ValueError):
        TrainConfig("tiny:qwen3", **bad)


@pytest.mark.parametrize("raw, key, instead", [
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps", "accumulates until step()"),
    ({"gradient_clipping": 0.5}, "gradient_clipping", "OptimConfig.grad_clip"),
    ({"fp16": {"enabled": True}}, "fp16", "set dtype"),
    ({"optimizer": {"type": "Adam"}}, "optimizer", "AdamW from OptimConfig"),
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "set zero_stage"),
])
def test_raw_deepspeed_keys_polynya_sets_are_refused(raw, key, instead):
    """A raw override of a key polynya derives from its own settings would change the update
    behind them (DeepSpeed divides each loss by gradient_accumulation_steps, clips by its own
    gradient_clipping, ...): refused at config time, naming the setting to use. Others merge."""
    from polynya.config.logprob import LogProbConfig

    for make in (lambda d: TrainConfig("tiny:qwen3", deepspeed=d),
                 lambda d: LogProbConfig("tiny:qwen3", deepspeed=d)):
        with pytest.raises(ValueError, match=f"sets '{key}', which polynya sets itself: .*{instead}"):
            make(raw)
    TrainConfig("tiny:qwen3", deepspeed={"steps_per_print": 5,
                                         "zero_optimization": {"overlap_comm": True}})


@pytest.mark.parametrize("bad", [dict(schedule="linear"), dict(schedule="warmup_cosine"), dict(betas=(0.9,)),
                                 dict(grad_clip=-1.0), dict(warmup_steps=5, total_steps=5, schedule="warmup_cosine")])
def test_optim_config_validation(bad):
    with pytest.raises(ValueError):
        OptimConfig(**bad)


def test_warmup_cosine_schedule():
    o = OptimConfig(schedule="warmup_cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    f = [o.lr_factor(s) for s in range(14)]
    assert f[0] < f[1] < f[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[2:], f[3:]))
    assert f[12] == pytest.approx(0.1) and f[13] == pytest.approx(0.1)


def test_a_response_longer_than_dr_grpos_constant_is_refused():
    """Dr.GRPO divides by ``max_response_len``, the longest response the sampler may write; a
    longer response was weighted above 1 / sequences per token, silently."""
    mask = torch.tensor([[True] * 5, [True] * 2 + [False] * 3])
    assert Normalizer.from_mask(mask, 5).constant_len == 5
    with pytest.raises(ValueError, match="a response of 5 tokens is longer than LossConfig.max_response_len=4"):
        Normalizer.from_mask(mask, 4)


def test_min_lr_ratio_refuses_a_bool():
    """``True`` was read as 1.0 (no decay at all)."""
    with pytest.raises(ValueError, match="min_lr_ratio must be in"):
        OptimConfig(schedule="warmup_cosine", total_steps=4, min_lr_ratio=True)

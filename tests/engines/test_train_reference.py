"""TrainingEngine against an independent plain-torch oracle: the documented loss, its gradient,
clipping, AdamW and the LR schedule, written out by hand on the plain HF model.

The oracle takes each sample's log-probs from one forward of ``prompt + response`` through the
plain model (``log_softmax(logits / T)``), builds the loss of ``polynya.losses``' docstring with
plain torch (not ``policy_loss``), backpropagates it ONCE over the whole batch, clips by the global
norm (``clip_grad_norm_``) and applies ``torch.optim.AdamW`` at the documented LR of each step.
The engine splits the same batch into several micro-batches of whole, differently sized prompt
groups (ragged and empty responses included), with ZoRRo on and off, ZeRO-0 and ZeRO-2: its
metrics, grad norm, LR and weights after every step must equal the oracle's.
"""
from __future__ import annotations

import math

import pytest
import torch
from polynya import RolloutBatch
from polynya.config.train import LossConfig, OptimConfig
from polynya.engines.train import TrainingEngine
from polynya.models import load_model

from .common import CUDA, MODEL, VOCAB, full_weights, train_config

TEMPERATURE = 0.7


def ragged_batch(seed: int, sizes=(1, 3, 2, 4), per_token: bool = False) -> RolloutBatch:
    """Prompt groups of different sizes, responses of 0-9 tokens (one empty)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for k, size in enumerate(sizes):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for j in range(size):
            n = 0 if (k, j) == (1, 1) else int(torch.randint(1, 10, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(2, VOCAB, (n,), generator=g).tolist())
    b, r = len(prompts), max(len(x) for x in responses)
    adv = torch.randn((b, r) if per_token else (b,), generator=g)
    return RolloutBatch(prompts, responses, advantages=adv)


def plain_stats(model, batch: RolloutBatch, temperature: float):
    """``[B, R]`` log-probs and entropies of each response token, one plain forward per sample."""
    b, r = len(batch), batch.max_response_len
    lp, ent = [torch.zeros(r)] * b, [torch.zeros(r)] * b
    for i, (p, s) in enumerate(zip(batch.prompts, batch.responses)):
        if s.size == 0:
            continue
        ids = torch.tensor([*p.tolist(), *s.tolist()])[None]
        logits = model(input_ids=ids).logits[0, p.size - 1:p.size - 1 + s.size].float() / temperature
        logp = torch.log_softmax(logits, -1)
        pad = (0, r - s.size)
        lp[i] = torch.nn.functional.pad(logp.gather(-1, torch.tensor(s)[:, None]).squeeze(-1), pad)
        ent[i] = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), pad)
    return torch.stack(lp), torch.stack(ent)


def oracle_loss(name: str, lc: LossConfig, logp, ent, batch: RolloutBatch):
    """The documented loss (``polynya.losses``), written out; returns (loss, metrics)."""
    defaults = {"ppo": (0.2, 0.2, "token"), "grpo": (0.2, 0.2, "sequence"),
                "dapo": (0.2, 0.28, "token"), "dr_grpo": (0.2, 0.2, "constant"),
                "gspo": (3e-4, 4e-4, "sequence")}[name]
    low = defaults[0] if lc.clip_low is None else lc.clip_low
    high = defaults[1] if lc.clip_high is None else lc.clip_high
    norm = lc.norm or defaults[2]
    kl_norm = lc.kl_norm or norm
    m = batch.response_mask().float()
    lens = m.sum(-1)
    n_tok, n_seq = m.sum(), (lens > 0).sum()
    big_l = lc.max_response_len or lens.max()

    def weights(kind):
        return {"token": m / n_tok, "sequence": m / (lens.clamp_min(1)[:, None] * n_seq),
                "constant": m / (n_seq * big_l), "sum": m}[kind]

    adv = batch.advantages if batch.advantages.dim() == 2 else batch.advantages[:, None].expand_as(m)
    old = batch.old_logprobs
    log_ratio = (logp - old) * m
    if name == "gspo":
        seq = log_ratio.sum(-1, keepdim=True) / lens.clamp_min(1)[:, None]
        log_ratio = seq.detach() + logp - logp.detach()
    if lc.log_ratio_clip is not None:
        log_ratio = log_ratio.clamp(-lc.log_ratio_clip, lc.log_ratio_clip)
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-ratio * adv, -ratio.clamp(1 - low, 1 + high) * adv) * m
    loss = (weights(norm) * pg).sum()
    tok = weights("token")
    clipped = ((ratio < 1 - low) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    metrics = {"pg_loss": loss.detach(), "clip_frac": (tok * clipped).sum(), "ratio": (tok * ratio).sum()}
    if batch.ref_logprobs is not None:
        d = (batch.ref_logprobs - logp) * m
        kl = {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d.clamp(-20, 20)) - 1 - d.clamp(-20, 20)}[lc.kl_estimator]
        if lc.kl_clip is not None:
            kl = kl.clamp(-lc.kl_clip, lc.kl_clip)
        loss = loss + lc.kl_coef * (weights(kl_norm) * kl).sum()
        metrics["kl"] = (tok * kl).sum()
    loss = loss - lc.entropy_coef * (weights(norm) * ent).sum()
    metrics["entropy"] = (tok * ent).sum()
    metrics["loss"] = loss
    return loss, {k: float(v.detach()) for k, v in metrics.items()}


def documented_lr(optim: OptimConfig, lr: float, step: int) -> float:
    """``OptimConfig``'s docstring: linear warm-up as (step + 1) / (warmup + 1), then constant or
    a cosine from ``lr`` down to ``min_lr_ratio * lr`` at ``total_steps``."""
    w = optim.warmup_steps
    if step < w:
        return lr * (step + 1) / (w + 1)
    if optim.schedule == "constant":
        return lr
    t = min(step - w, optim.total_steps - w) / (optim.total_steps - w)
    return lr * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * (1 + math.cos(math.pi * t)) / 2)


def with_logprobs(batch: RolloutBatch, model, seed: int, ref: bool) -> RolloutBatch:
    """The batch with old (and reference) log-probs near the plain model's: ratios near the clip."""
    with torch.no_grad():
        lp, _ = plain_stats(model, batch, TEMPERATURE)
    g = torch.Generator().manual_seed(seed)
    m = batch.response_mask()
    old = torch.where(m, lp + 0.25 * torch.randn(lp.shape, generator=g), torch.zeros(()))
    refs = torch.where(m, lp + 0.5 * torch.randn(lp.shape, generator=g), torch.zeros(())) if ref else None
    return RolloutBatch(batch.prompts, batch.responses, advantages=batch.advantages,
                        old_logprobs=old, ref_logprobs=refs)


CASES = {
    "grpo-k3-entropy": {"loss": "grpo", "lc": LossConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.05)},
    "ppo-k2-seq-kl": {"loss": "ppo", "lc": LossConfig(kl_coef=0.2, kl_estimator="k2", kl_norm="sequence",
                                                       clip_low=0.1, clip_high=0.3)},
    "drgrpo-k1": {"loss": "dr_grpo", "lc": LossConfig(kl_coef=0.05, kl_estimator="k1", max_response_len=12)},
    "dapo-per-token-kl-clip": {"loss": "dapo", "per_token": True,
                               "lc": LossConfig(kl_coef=0.3, kl_clip=0.05, log_ratio_clip=0.25)},
    "gspo": {"loss": "gspo", "lc": LossConfig(clip_low=0.05, clip_high=0.08)},
    "sum": {"loss": "ppo", "per_token": True, "lc": LossConfig(norm="sum", kl_coef=0.1, kl_norm="token")},
}


def run_against_oracle(stage: int, zorro: bool, case: dict, **engine_kw) -> None:
    """Three steps of the engine (``train_config(stage, ...)`` with ``engine_kw``) against the
    oracle on the CPU, with clipping active and the LR warming up, then following the cosine."""
    name, lc, per_token = case["loss"], case["lc"], case.get("per_token", False)
    optim = OptimConfig(eps=1e-4, weight_decay=0.01, grad_clip=0.5, schedule="warmup_cosine",
                        warmup_steps=1, total_steps=4, min_lr_ratio=0.2)
    lr = 2e-3
    engine = TrainingEngine(train_config(stage, loss=name, loss_config=lc, zorro=zorro, lr=lr, optim=optim,
                                         micro_batch_tokens=24, temperature=TEMPERATURE, **engine_kw))
    oracle = load_model(MODEL, dtype="float32", seed=0)
    oracle.train()
    opt = torch.optim.AdamW(oracle.parameters(), lr=lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay)
    ref = lc.kl_coef > 0
    # step 0: one batch; step 1: two forward_backward calls (their losses add); step 2: one
    plan = [[0], [1, 2], [3]]
    for step, seeds in enumerate(plan):
        opt.zero_grad()
        batches = [with_logprobs(ragged_batch(10 + s, per_token=per_token), oracle, s, ref) for s in seeds]
        for batch in batches:
            got = engine.forward_backward(batch)
            assert got["micro_batches"] >= 2
            logp, ent = plain_stats(oracle, batch, TEMPERATURE)
            loss, want = oracle_loss(name, lc, logp, ent, batch)
            loss.backward()
            assert 0 < want["clip_frac"] < 1  # the clip range is reached, and not everywhere
            for k, v in want.items():
                assert got[k] == pytest.approx(v, rel=2e-5, abs=1e-6), (step, k)
            assert got["response_tokens"] == int(batch.response_mask().sum())
            assert got["sequences"] == sum(r.size > 0 for r in batch.responses)  # empty responses are not sequences
        norm = float(torch.nn.utils.clip_grad_norm_(oracle.parameters(), optim.grad_clip))
        assert norm > optim.grad_clip  # clipping is active
        for group in opt.param_groups:
            group["lr"] = documented_lr(optim, lr, step)
        opt.step()
        info = engine.step()
        assert info["grad_norm"] == pytest.approx(norm, rel=2e-5), step
        assert info["lr"] == pytest.approx(documented_lr(optim, lr, step), rel=1e-12), step
        weights = full_weights(engine.module)
        for pname, p in oracle.named_parameters():
            where = f"step {step}, {pname}"
            torch.testing.assert_close(weights[pname], p.detach(), rtol=1e-4, atol=2e-6,
                                       msg=lambda s, where=where: f"{where}: {s}")


@pytest.mark.parametrize("zorro", [True, False])
@pytest.mark.parametrize("stage", [0, 2])
def test_engine_equals_full_batch_oracle(stage, zorro):
    run_against_oracle(stage, zorro, CASES["grpo-k3-entropy"])


@pytest.mark.parametrize("case", [c for c in CASES if c != "grpo-k3-entropy"])
def test_every_loss_equals_full_batch_oracle(case):
    run_against_oracle(2, True, CASES[case])


@pytest.mark.parametrize("zorro", [True, False])
@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_engine_equals_full_batch_oracle_gpu(device, stage, zorro):
    """The CUDA paths (Triton LM head, FlexAttention / packed varlen, fused AdamW) against the
    CPU oracle."""
    run_against_oracle(stage, zorro, CASES["grpo-k3-entropy"], device=device,
                       zorro_attention="flex" if zorro else "auto")

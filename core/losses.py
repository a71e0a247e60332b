"""Policy-gradient losses for RL post-training: PPO/GRPO, DAPO, Dr.GRPO, GSPO, KL, entropy.

Every loss is a weighted sum over response tokens::

    loss = sum_{i,t} w[i,t] * (pg[i,t] + kl_coef * kl[i,t] - entropy_coef * H[i,t])

where ``pg`` is the clipped surrogate ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` and
the weights ``w`` are the loss's *normalisation*, computed from the **global** batch (all
micro-batches of all data-parallel ranks) by ``Normalizer``:

- ``"token"``    (PPO, DAPO):  ``w = 1 / N_tokens``; the token-level mean over the global batch;
- ``"sequence"`` (GRPO, GSPO): ``w = 1 / (len_i * N_seqs)``; mean over tokens of each response,
  then mean over the global batch's responses;
- ``"constant"`` (Dr.GRPO):   ``w = 1 / (N_seqs * L)`` with ``L`` a fixed length (config, else
  the global batch's longest response); no length bias;
- ``"sum"``: ``w = 1``; for advantages the caller has already scaled by its normalisation
  (SkyRL's trainer does, ``polynya.adapters.skyrl``).

The KL term may have a normalisation of its own (``LossConfig.kl_norm``; default: the loss's):
``loss = sum w * pg + kl_coef * sum w_kl * kl - entropy_coef * sum w * H``.

Because the denominators are global, a micro-batch's loss is its share of the global loss: the
sum of micro-batch losses (and their gradients) is the same however the batch is split into
micro-batches or DP ranks. ``N_seqs`` counts responses with at least one token.

Ratios: per token ``r = exp(logp - old_logp)`` (PPO, GRPO, DAPO, Dr.GRPO); GSPO uses the
sequence ratio ``s_i = exp(mean_t(logp - old_logp))`` in its token form
``r[i,t] = sg(s_i) * exp(logp - sg(logp))`` (equal to GSPO for per-sequence advantages, and
GSPO-token for per-token ones). ``old_logp=None`` means on-policy: ``old = logp.detach()``.
``LossConfig.log_ratio_clip = c`` clamps the log of each ratio to ``[-c, c]`` before ``exp``
(verl's and SkyRL's PPO: ``c = 20``; no gradient outside).

KL to the reference, with ``d = ref_logp - logp``: ``k1 = -d``, ``k2 = d^2 / 2``,
``k3 = exp(d) - 1 - d`` with ``d`` clamped to ``[-20, 20]`` (Schulman, "Approximating KL
divergence"; the clamp as in verl and SkyRL, whose k1 / k2 have none either).
``LossConfig.kl_clip = c`` clamps each token's estimate to ``[-c, c]`` (SkyRL's and verl's k3:
``c = 10``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config.train import LOSSES, LossConfig

# name -> (clip_low, clip_high, normalisation, sequence-level ratio)
_DEFAULTS = {
    "ppo": (0.2, 0.2, "token", False),
    "grpo": (0.2, 0.2, "sequence", False),
    "dapo": (0.2, 0.28, "token", False),
    "dr_grpo": (0.2, 0.2, "constant", False),
    "gspo": (3e-4, 4e-4, "sequence", True),
}
assert set(_DEFAULTS) == set(LOSSES)


@dataclass(frozen=True)
class LossSpec:
    """A loss with its defaults resolved (``resolve_loss``)."""

    name: str
    clip_low: float
    clip_high: float
    norm: str
    sequence_ratio: bool
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    max_response_len: int | None
    kl_norm: str
    log_ratio_clip: float | None = None
    kl_clip: float | None = None


def resolve_loss(name: str, config: LossConfig | None = None) -> LossSpec:
    """Fill the loss's defaults into ``config``; ``ValueError`` for an unknown name."""
    if name not in _DEFAULTS:
        raise ValueError(f"unknown loss {name!r}; choose one of {LOSSES}")
    cfg = config or LossConfig()
    low, high, norm, seq = _DEFAULTS[name]
    norm = cfg.norm or norm
    return LossSpec(name, low if cfg.clip_low is None else cfg.clip_low,
                    high if cfg.clip_high is None else cfg.clip_high, norm, seq,
                    cfg.kl_coef, cfg.kl_estimator, cfg.entropy_coef, cfg.max_response_len,
                    cfg.kl_norm or norm, cfg.log_ratio_clip, cfg.kl_clip)


@dataclass(frozen=True)
class Normalizer:
    """Global denominators of one training batch (every micro-batch on every rank).

    num_tokens: response tokens; num_sequences: responses with >= 1 token;
    constant_len: Dr.GRPO's ``L``.
    """

    num_tokens: int
    num_sequences: int
    constant_len: int

    @classmethod
    def from_mask(cls, mask: torch.Tensor, max_response_len: int | None = None) -> Normalizer:
        """From the global batch's ``[B, Rmax]`` response mask."""
        lens = mask.sum(-1)
        n_tok = int(lens.sum())
        if n_tok == 0:
            raise ValueError("the batch has no response tokens: nothing to train on")
        longest = int(lens.max())
        if max_response_len is not None and longest > max_response_len:
            raise ValueError(f"a response of {longest} tokens is longer than LossConfig."
                             f"max_response_len={max_response_len}, Dr.GRPO's constant (the longest "
                             "response the sampler may write): set it to the generation length")
        return cls(n_tok, int((lens > 0).sum()), max_response_len or longest)


@dataclass
class LossOutput:
    """``loss``: scalar to backpropagate (this micro-batch's share of the global loss).
    ``metrics``: scalar tensors that are likewise shares: summed over micro-batches and ranks
    they give the global value (``pg_loss``, ``kl``, ``entropy``, ``clip_frac``, ``ratio``;
    all but ``pg_loss`` are token means)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate ``[B, R]`` from log-probs of the sampled tokens (k3's
    exponent clamped to ``[-20, 20]``; module docstring)."""
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-20.0, 20.0)
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def token_weights(norm: str, mask: torch.Tensor, normalizer: Normalizer) -> torch.Tensor:
    """``[B, R]`` float weights of the normalisation ``norm`` (module docstring)."""
    m = mask.float()
    if norm == "token":
        return m / normalizer.num_tokens
    if norm == "sequence":
        return m / (m.sum(-1, keepdim=True).clamp_min(1.0) * normalizer.num_sequences)
    if norm == "constant":
        return m / (normalizer.num_sequences * normalizer.constant_len)
    if norm == "sum":
        return m
    raise ValueError(f"unknown normalisation {norm!r}")


def _ratio(spec: LossSpec, log_ratio: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor):
    if spec.sequence_ratio:
        m = mask.float()
        seq = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
        log_ratio = seq.detach() + logprobs - logprobs.detach()
    if spec.log_ratio_clip is not None:
        log_ratio = log_ratio.clamp(-spec.log_ratio_clip, spec.log_ratio_clip)
    return torch.exp(log_ratio)


def policy_loss(spec: LossSpec, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                normalizer: Normalizer, *, old_logprobs: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None) -> LossOutput:
    """One micro-batch's share of the global loss.

    Args:
        spec: the loss (``resolve_loss``).
        logprobs: ``[B, R]`` current log-probs (differentiable).
        advantages: ``[B]`` per response or ``[B, R]`` per token.
        mask: ``[B, R]`` bool, True on response tokens.
        normalizer: the global batch's denominators.
        old_logprobs: ``[B, R]`` behaviour-policy log-probs; None = on-policy (ratio 1).
        ref_logprobs: ``[B, R]`` reference log-probs; required when ``spec.kl_coef > 0``.
        entropy: ``[B, R]`` per-token entropy; required when ``spec.entropy_coef != 0``.
    Returns:
        ``LossOutput``.
    """
    shape = logprobs.shape
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        advantages = advantages[:, None].expand(shape)
    for name, t in (("advantages", advantages), ("mask", mask), ("old_logprobs", old_logprobs),
                    ("ref_logprobs", ref_logprobs), ("entropy", entropy)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if spec.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if spec.entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the entropy")
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    zero = torch.zeros((), device=logprobs.device)
    log_ratio = torch.where(mask, logprobs - old, zero)
    adv = torch.where(mask, advantages, zero)
    ratio = _ratio(spec, log_ratio, logprobs, mask)
    clipped_ratio = ratio.clamp(1.0 - spec.clip_low, 1.0 + spec.clip_high)
    pg = torch.maximum(-ratio * adv, -clipped_ratio * adv)
    clipped = ((ratio < 1.0 - spec.clip_low) & (adv < 0)) | ((ratio > 1.0 + spec.clip_high) & (adv > 0))

    w = token_weights(spec.norm, mask, normalizer)
    w_tok = token_weights("token", mask, normalizer)
    total = pg
    metrics = {"pg_loss": (w * pg).sum(),
               "clip_frac": (w_tok * clipped.float()).sum().detach(),
               "ratio": (w_tok * ratio).sum().detach()}
    kl_term = zero
    if ref_logprobs is not None:
        ref = torch.where(mask, ref_logprobs, logprobs.detach())  # d = 0 off the mask (no inf there)
        kl = kl_penalty(logprobs, ref, spec.kl_estimator)
        if spec.kl_clip is not None:
            kl = kl.clamp(-spec.kl_clip, spec.kl_clip)
        kl = torch.where(mask, kl, zero)
        metrics["kl"] = (w_tok * kl).sum().detach()
        if spec.kl_coef > 0 and spec.kl_norm != spec.norm:
            kl_term = spec.kl_coef * (token_weights(spec.kl_norm, mask, normalizer) * kl).sum()
        elif spec.kl_coef > 0:
            total = total + spec.kl_coef * kl
    if entropy is not None:
        ent = torch.where(mask, entropy, zero)
        metrics["entropy"] = (w_tok * ent).sum().detach()
        if spec.entropy_coef != 0:
            total = total - spec.entropy_coef * ent
    loss = (w * total).sum() + kl_term
    metrics["pg_loss"] = metrics["pg_loss"].detach()
    return LossOutput(loss, metrics)

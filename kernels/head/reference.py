"""Plain-torch token statistics of a chunk of logits: the CPU path and the kernels' oracle.

``row_stats_reference(logits, target, temperature, entropy)`` -> (logp ``[c]``, lse ``[c]``,
entropy ``[c]`` | None), fp32. ``logit_grad_reference(logits, target, lse, ent, g_lp, g_ent,
temperature)`` -> d(``g_lp * logp + g_ent * entropy``)/d logits in the logits' dtype.
"""
from __future__ import annotations

import torch


def row_stats_reference(logits: torch.Tensor, target: torch.Tensor, temperature: float,
                        entropy: bool):
    z = logits.to(torch.float32, copy=True).div_(temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, target[:, None]).squeeze(-1) - lse
    ent = None
    if entropy:
        z.sub_(lse[:, None])                                    # log p
        ent = -(z.exp() * z).sum(-1)
    return logp, lse, ent


def logit_grad_reference(logits, target, lse, ent, g_lp, g_ent, temperature: float):
    z = logits.to(torch.float32, copy=True).div_(temperature).sub_(lse[:, None])  # log p
    if g_ent is not None:
        # d/dz of  g_lp * logp_t + g_ent * H  =  g_lp * onehot_t - p * (g_lp + g_ent * (log p + H))
        p = z.exp()
        dz = z.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
        del p
    else:
        dz = z.exp_().mul_(-g_lp[:, None])
    dz.scatter_add_(1, target[:, None], g_lp[:, None])
    return dz.div_(temperature).to(logits.dtype)

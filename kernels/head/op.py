"""Launchers of the LM-head statistics: Triton on CUDA, ``reference.py`` elsewhere.

``row_stats(logits, target, temperature, entropy)`` -> (logp, lse, entropy | None) fp32 ``[c]``;
``logit_grad(logits, target, lse, ent, g_lp, g_ent, temperature)`` -> the logit gradient in the
logits' dtype — on CUDA written over ``logits`` in place (the chunk buffer is reused, not copied).
"""
from __future__ import annotations

import torch

from .reference import logit_grad_reference, row_stats_reference

BLOCK_V = 2048


def _rows_ok(logits: torch.Tensor) -> bool:
    return logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[0] > 0


def row_stats(logits: torch.Tensor, target: torch.Tensor, temperature: float, entropy: bool):
    if not _rows_ok(logits):
        return row_stats_reference(logits, target, temperature, entropy)
    from .kernel import _row_stats_kernel

    n, vocab = logits.shape
    logp, lse = (torch.empty(n, device=logits.device, dtype=torch.float32) for _ in range(2))
    ent = torch.empty_like(lse) if entropy else lse
    _row_stats_kernel[(n,)](logits, target, logp, lse, ent, vocab, logits.stride(0),
                            1.0 / temperature, WANT_ENT=entropy, BLOCK_V=BLOCK_V, num_warps=8)
    return logp, lse, (ent if entropy else None)


def logit_grad(logits, target, lse, ent, g_lp, g_ent, temperature: float) -> torch.Tensor:
    if not _rows_ok(logits):
        return logit_grad_reference(logits, target, lse, ent, g_lp, g_ent, temperature)
    from .kernel import _logit_grad_kernel

    has_ent = g_ent is not None
    g_lp = g_lp.float().contiguous()
    g_ent = g_ent.float().contiguous() if has_ent else g_lp
    _logit_grad_kernel[(logits.shape[0],)](
        logits, target, lse, ent if has_ent else lse, g_lp, g_ent, logits.shape[1], logits.stride(0),
        1.0 / temperature, HAS_ENT=has_ent, BLOCK_V=BLOCK_V, num_warps=8)
    return logits

"""Launchers of the LM-head statistics: Triton on CUDA, ``reference.py`` elsewhere.

``row_stats(logits, target, temperature, entropy)`` -> (logp, lse, entropy | None) fp32 ``[c]``;
``logit_grad(logits, target, lse, ent, g_lp, g_ent, temperature)`` -> the logit gradient in the
logits' dtype — on CUDA written over ``logits`` in place (the chunk buffer is reused, not copied).
Target ids must be < vocab: checking that on the device would cost a sync per chunk, so it is the
caller's job (``compute_logprobs`` checks every token id once per batch); shapes are checked here.
"""
from __future__ import annotations

import torch

from .reference import logit_grad_reference, row_stats_reference

BLOCK_V = 2048


def _check(logits: torch.Tensor, target: torch.Tensor, temperature: float, *rows) -> None:
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [n, vocab] and target [n]; got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    for r in rows:
        if r is not None and r.shape != target.shape:
            raise ValueError(f"per-row inputs must be [{target.shape[0]}], got {tuple(r.shape)}")


def _rows_ok(logits: torch.Tensor) -> bool:
    return logits.is_cuda and logits.stride(1) == 1 and logits.shape[0] > 0


def row_stats(logits: torch.Tensor, target: torch.Tensor, temperature: float, entropy: bool):
    _check(logits, target, temperature)
    if not _rows_ok(logits):
        return row_stats_reference(logits, target, temperature, entropy)
    from .kernel import _row_stats_kernel

    n, vocab = logits.shape
    logp, lse = (torch.empty(n, device=logits.device, dtype=torch.float32) for _ in range(2))
    ent = torch.empty_like(lse) if entropy else lse
    _row_stats_kernel[(n,)](logits, target.contiguous(), logp, lse, ent, vocab, logits.stride(0),
                            1.0 / temperature, WANT_ENT=entropy, BLOCK_V=BLOCK_V, num_warps=8)
    return logp, lse, (ent if entropy else None)


def logit_grad(logits, target, lse, ent, g_lp, g_ent, temperature: float) -> torch.Tensor:
    _check(logits, target, temperature, lse, ent, g_lp, g_ent)
    if (g_ent is None) != (ent is None):
        raise ValueError("logit_grad needs both ent and g_ent for the entropy term, or neither")
    if not _rows_ok(logits):
        return logit_grad_reference(logits, target, lse, ent, g_lp, g_ent, temperature)
    from .kernel import _logit_grad_kernel

    has_ent = g_ent is not None
    lse, g_lp = lse.float().contiguous(), g_lp.float().contiguous()
    ent, g_ent = (ent.float().contiguous(), g_ent.float().contiguous()) if has_ent else (lse, g_lp)
    _logit_grad_kernel[(logits.shape[0],)](
        logits, target.contiguous(), lse, ent, g_lp, g_ent, logits.shape[1], logits.stride(0),
        1.0 / temperature, HAS_ENT=has_ent, BLOCK_V=BLOCK_V, num_warps=8)
    return logits

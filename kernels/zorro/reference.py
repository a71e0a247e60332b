"""Plain-torch pieces of split ZoRRo attention in fp32: the test oracle and the CPU fallback.

Tensors are token-major: ``q [Lq, Hq, D]``, ``k`` / ``v`` ``[Lk, Hkv, D]`` (``Hq`` a multiple of
``Hkv``), LSE ``[Hq, Lq]`` fp32 natural log. ``dense_forward`` / ``dense_backward`` are one call
of the split (top-left causal: query ``i`` sees keys ``j <= i``, so with ``Lq > Lk`` every
query past ``Lk`` sees all keys). The backward takes the *final* output and LSE of the whole
attention — the ring-attention identity that makes per-part backwards exact.
``combine_reference`` merges partials by log-sum-exp (or sums gradients)::

    o, lse = dense_forward(q, k, v, scale)
    dq, dk, dv = dense_backward(do, q, k, v, o_final, lse_final, scale)
    out, lse = combine_reference(parts, lse_parts, src)
"""
from __future__ import annotations

import torch


def _f(x: torch.Tensor) -> torch.Tensor:
    """fp32 math (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", _f(q), _f(k).repeat_interleave(rep, 1)) * scale
    lq, lk = q.shape[0], k.shape[0]
    hidden = torch.arange(lk, device=q.device)[None, :] > torch.arange(lq, device=q.device)[:, None]
    return s.masked_fill(hidden, float("-inf"))


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Top-left causal attention -> (``o [Lq, Hq, D]`` in q's dtype, ``lse [Hq, Lq]`` fp32)."""
    s = _scores(q, k, scale)
    lse = s.logsumexp(-1)
    rep = q.shape[1] // k.shape[1]
    o = torch.einsum("hqk,khd->qhd", (s - lse[..., None]).exp(), _f(v).repeat_interleave(rep, 1))
    return o.to(q.dtype), lse


def dense_backward(do, q, k, v, o, lse, scale: float):
    """Gradients of one call given the final ``o`` / ``lse`` of its queries -> (dq, dk, dv)."""
    rep = q.shape[1] // k.shape[1]
    kf, vf = (_f(x).repeat_interleave(rep, 1) for x in (k, v))
    p = (_scores(q, k, scale) - _f(lse)[..., None]).exp()              # [H, Lq, Lk]
    dof = _f(do)
    dv = torch.einsum("hqk,qhd->khd", p, dof)
    dp = torch.einsum("qhd,khd->hqk", dof, vf)
    delta = (dof * _f(o)).sum(-1).transpose(0, 1)                       # [H, Lq]
    ds = p * (dp - delta[..., None]) * scale
    dq = torch.einsum("hqk,khd->qhd", ds, kf)
    dk = torch.einsum("hqk,qhd->khd", ds, _f(q))
    fold = (lambda g: g.view(g.shape[0], -1, rep, g.shape[-1]).sum(2))      # GQA: sum the group
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


def combine_reference(parts: list[torch.Tensor], lse_parts: list[torch.Tensor] | None,
                      src: torch.Tensor):
    """Merge each token's partial rows.

    Args:
        parts: partial outputs (or gradients) ``[rows_p, H, D]``, one tensor per part;
        lse_parts: their LSEs ``[H, rows_p]`` fp32, or None to sum the rows.
        src: ``[T, K]`` int64 ``part << 32 | row`` per token, ``-1`` = none.
    Returns:
        with LSEs: the exact softmax merge ``out [T, H, D]`` (parts' dtype) and ``lse [H, T]``
        (``-inf`` / zeros for a token without partials); without: the sum of the rows, None.
    """
    start = torch.tensor([0] + [p.shape[0] for p in parts[:-1]], device=src.device).cumsum(0)
    valid = src >= 0
    idx = torch.where(valid, start[(src >> 32).clamp(min=0)] + (src & 0xFFFFFFFF), 0)
    flat = torch.cat(parts)
    rows = _f(flat[idx]) * valid[..., None, None]                           # [T, K, H, D]
    if lse_parts is None:
        return rows.sum(1).to(flat.dtype), None
    part_lse = _f(torch.cat(lse_parts, 1))[:, idx].permute(1, 2, 0).masked_fill(~valid[..., None], float("-inf"))
    lse = part_lse.logsumexp(1)                                             # [T, H]
    w = (part_lse - lse[:, None]).exp().nan_to_num(0.0)
    return (w[..., None] * rows).sum(1).to(flat.dtype), lse.transpose(0, 1).contiguous()

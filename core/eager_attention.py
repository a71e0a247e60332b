"""Plain-torch attention under a boolean mask, with the score modifiers SDPA cannot apply.

``eager_attention`` is what transformers' own ``eager_attention_forward`` computes (scores in
fp32, ``c * tanh(s / c)`` soft-cap, masked softmax, GQA by repeating key/value heads); polynya
uses it where a fused kernel cannot take the model: ZoRRo's dense CPU path and the native
sampler's prefill for soft-capped models (Gemma 2), and any ordinary call of the ``"polynya"``
attention that carries a soft-cap::

    out = eager_attention(q, k, v, mask, scale, softcap=50.0)   # [b, Hq, Lq, D] -> same
"""
from __future__ import annotations

import torch


def causal_mask(q_len: int, k_len: int, device, window: int | None = None) -> torch.Tensor:
    """``[q_len, k_len]`` bool: the queries are the last ``q_len`` positions of ``k_len``; each
    sees keys ``j`` with ``0 <= i - j`` (and ``i - j < window`` when a window is given)."""
    i = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    keep = j <= i
    return keep & (i - j < window) if window is not None else keep


SCORES_PER_CHUNK = 1 << 27  # fp32 scores alive at once (512 MiB): queries run in chunks


def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, scale: float, softcap: float | None = None
                    ) -> torch.Tensor:
    """Attention of ``query [b, Hq, Lq, D]`` over ``key`` / ``value`` ``[b, Hkv, Lk, D]``.

    Args:
        mask: bool, broadcastable to ``[b, Hq, Lq, Lk]`` (True = visible), or None (all keys).
        scale: softmax scale; softcap: ``c`` of ``c * tanh(score / c)`` or None.
    Returns:
        ``[b, Hq, Lq, D]`` in the query's dtype. A query with no visible key gets zeros.
        Queries run in chunks of at most ``SCORES_PER_CHUNK`` scores (a long prefill never
        holds all ``[Hq, Lq, Lk]`` scores at once); autograd flows through every chunk.
    """
    rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(rep, 1) if rep > 1 else key
    v = value.repeat_interleave(rep, 1) if rep > 1 else value
    b, h, lq, lk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    step = max(1, SCORES_PER_CHUNK // max(1, b * h * lk))
    outs = []
    for s in range(0, lq, step):
        scores = torch.matmul(query[:, :, s:s + step], k.transpose(-1, -2)).float() * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if mask is not None:
            m = mask[..., s:s + step, :] if mask.shape[-2] != 1 else mask
            scores = scores.masked_fill(~m, float("-inf"))
        probs = scores.softmax(-1).nan_to_num(0.0).to(value.dtype)
        outs.append(torch.matmul(probs, v))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

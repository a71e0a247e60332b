"""Plain-torch paged decode attention in fp32: the test oracle and the CPU fallback.

One query token per request attends to its own KV positions ``[0, seq_len)``, which live in a
paged cache addressed through ``block_tables`` (requests that share a prefix share physical
block ids; the math does not care). Used by ``paged_decode`` / ``fca_decode`` on CPU and by
every kernel test as the ground truth::

    out, lse = paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                      return_lse=True)
"""
from __future__ import annotations

import math

import torch


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a paged KV cache, computed in fp32.

    Args:
        q: ``[B, Hq, D]`` one query token per request.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``; ``Hq % Hkv == 0`` (GQA).
        block_tables: ``[B, max_blocks]`` int physical block ids; entries past a request's
            last block are ignored (may be -1).
        seq_lens: ``[B]`` int, ``1 <= seq_len <= max_blocks * block_size``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        return_lse: also return the natural-log log-sum-exp of the scaled scores.
        softcap: scores become ``softcap * tanh(score / softcap)`` (None: unchanged).
        window: each request sees only its last ``window`` positions (None: all of them).

    Returns:
        ``out [B, Hq, D]`` in ``q.dtype`` (and ``lse [B, Hq]`` fp32 if ``return_lse``).
    """
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    ids = block_tables.long().clamp(0, k_cache.shape[0] - 1)  # padded entries are masked below
    T = max_blocks * block_size
    k = k_cache[ids].reshape(B, T, Hkv, D).float()
    v = v_cache[ids].reshape(B, T, Hkv, D).float()
    rep = Hq // Hkv
    k = k.repeat_interleave(rep, dim=2)  # [B, T, Hq, D]
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(T, device=q.device)
    lens = seq_lens.to(q.device).long()[:, None]
    keep = pos[None, :] < lens  # [B, T]
    if window is not None:
        keep &= pos[None, :] >= lens - window
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bht,bthd->bhd", probs, v).to(q.dtype)
    return (out, lse) if return_lse else out

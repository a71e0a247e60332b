"""Varlen attention: packed tokens cut into segments, each its own causal sequence.

The packed *naive* layout (every sample its own segment, no padding: what verl's
``use_remove_padding`` runs through ``flash_attn_varlen_func``) is a prefix forest whose nodes
are all leaves; so is a ZoRRo batch that shares nothing. Its attention needs no mask, no plan
and no merge: one varlen call over cumulative segment boundaries::

    bounds = segment_bounds(nodes, T, row_len)       # host, once per batch
    cu = torch.from_numpy(bounds).to(device, torch.int32)
    out = varlen_attention(q, k, v, cu, max_len, scale)   # [T, Hq, D], [T, Hkv, D] -> [T, Hq, D]

Backends: ``"cuda"`` — the FlashAttention-2 varlen kernels built into torch
(``aten::_flash_attention_forward`` / ``_backward`` with cumulative lengths; the same kernels as
``flash_attn_varlen_func``, no flash-attn package needed): no work on padding, GQA native,
bf16 / fp16, head dim a multiple of 8 up to 256, sm80+; plain causal only (sliding-window and
soft-capped layers take FlexAttention, see ``polynya.zorro.attention``). ``"reference"`` — per
segment ``reference.dense_forward`` in fp32 (autograd), the test oracle.
"""
from __future__ import annotations

import numpy as np
import torch

from . import reference as ref
from .op import fused_inputs_reason
from .plan import check_nodes

_A = torch.ops.aten


def segment_bounds(nodes: np.ndarray, num_tokens: int, row_len: int | None = None) -> np.ndarray:
    """Cumulative boundaries ``[S + 1]`` (int64, from 0 to ``num_tokens``) of the segments.

    ``nodes`` is a node table ``[N, 3]`` (start, end, stop; flat token indices) of leaves only
    (``stop == end``), else ``ValueError``. Every node is a segment; the tokens between nodes
    (row padding) become segments of their own, cut at every multiple of ``row_len`` so that no
    segment crosses a row. Padding segments attend only among themselves.
    """
    nodes = np.asarray(nodes, dtype=np.int64)
    check_nodes(nodes, num_tokens)
    if (nodes[:, 2] != nodes[:, 1]).any():
        raise ValueError("varlen attention takes segments only (every node a leaf); these rows "
                         "share prefixes: use split or FlexAttention")
    rows = np.arange(0, num_tokens, row_len, dtype=np.int64) if row_len else np.zeros(1, np.int64)
    return np.unique(np.concatenate([rows, [num_tokens], nodes[:, 0], nodes[:, 1]]))


def unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the CUDA backend cannot run these inputs, or None when it can."""
    return fused_inputs_reason(q, k, kernels="FlashAttention", max_head_dim=256,
                               enabled=torch.backends.cuda.flash_sdp_enabled(),
                               switch="torch.backends.cuda.enable_flash_sdp")


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float):
        out, lse, rng, unused, _ = _A._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = _A._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True,
            rng, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def _reference(q, k, v, cu: torch.Tensor, scale: float) -> torch.Tensor:
    b = cu.tolist()
    return torch.cat([ref.dense_forward(q[s:e], k[s:e], v[s:e], scale)[0]
                      for s, e in zip(b[:-1], b[1:])])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_len: int, scale: float, backend: str | None = None) -> torch.Tensor:
    """Causal attention of every token over the earlier tokens of its own segment.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` token-major.
        cu_seqlens: ``[S + 1]`` int32 on q's device, 0 .. T ascending (``segment_bounds``).
        max_len: the longest segment; scale: softmax scale.
        backend: ``"cuda"`` / ``"reference"``; None picks cuda on GPU, reference elsewhere.
    Returns:
        ``[T, Hq, D]`` in q's dtype; differentiable in q, k, v.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2]:
        raise ValueError(f"varlen_attention expects q [T, Hq, D] and k, v [T, Hkv, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if (cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device
            or cu_seqlens.numel() < 2):
        raise ValueError(f"cu_seqlens must be [S + 1] int32 on {q.device}, got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype} on {cu_seqlens.device}")
    if backend is None:
        backend = "cuda" if q.is_cuda else "reference"
    if backend == "reference":
        return _reference(q, k, v, cu_seqlens, scale)
    if backend != "cuda":
        raise ValueError(f"backend must be 'cuda' or 'reference', got {backend!r}")
    if why := unsupported_reason(q, k):
        raise ValueError(f"varlen attention's CUDA backend cannot run: {why}; use FlexAttention")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _FlashVarlen.apply(q, k, v, cu_seqlens, int(max_len), float(scale))

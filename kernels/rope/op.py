"""Fused rotary embedding: Triton on CUDA (``RoPEFunction``), ``reference.py`` elsewhere.

``rope(q, k, cos, sin)`` computes HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim
=1``): ``q`` ``[B, Hq, T, D]``, ``k`` ``[B, Hk, T, D]`` (any strides: HF's are transposed views
of ``[B, T, H, D]``), ``cos``/``sin`` ``[B or 1, T, D]``; returns ``(q_embed, k_embed)`` laid
out like ``q``/``k``, differentiable in ``q`` and ``k``. On CUDA the forward and the backward
are one launch each for ``q`` and ``k`` together; HF's function is ~14 ops forward and more
backward (slices, negations, concatenations, products, sums). Equal to HF bit for bit in fp32,
bf16 and fp16 (``kernel.py``).

The kernel takes: one dtype for all four tensors (float32 / bfloat16 / float16), an even ``D``
up to ``2 * MAX_HALF``, ``cos``/``sin`` that do not need gradients (HF computes them under
``no_grad``). Anything else (CPU tensors, other shapes or dtypes) goes through
``rope_reference``, the same ops as HF's.
"""
from __future__ import annotations

import torch

from .reference import rope_reference

MAX_HALF = 512
TILE = 1024  # elements per half-head tile of a program (heads x D/2)
KERNEL_ON_CPU = False  # tests: the Triton path for CPU tensors too (TRITON_INTERPRET=1)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def kernel_applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """True when ``rope`` runs the Triton kernel for these tensors (else the reference)."""
    if not ((q.is_cuda or KERNEL_ON_CPU) and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3):
        return False
    b, _, t, d = q.shape
    return (all(x.device == q.device and x.dtype == q.dtype for x in (k, cos, sin))
            and q.dtype in _DTYPES and cos.shape == sin.shape and d % 2 == 0
            and 0 < d // 2 <= MAX_HALF and k.shape[0] == b and k.shape[2:] == (t, d)
            and cos.shape[1:] == (t, d) and cos.shape[0] in (1, b)
            and not (cos.requires_grad or sin.requires_grad))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_launch(q, k, cos, sin, *, backward: bool):
    """One launch: -> ``(q', k')`` rotated (or, ``backward``, the gradients for ``q``/``k``
    given those of the outputs), each laid out like its input."""
    from .kernel import _rope_kernel

    q, k, cos, sin = (_unit_last(x) for x in (q, k, cos, sin))
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    b, hq, t, d = q.shape
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    half = d // 2
    block_half = _next_pow2(half)
    block_heads = max(1, min(_next_pow2(max(hq, k.shape[1])), TILE // block_half))
    cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    sb = 0 if sin.shape[0] == 1 else sin.stride(0)
    _rope_kernel[(b * t,)](
        q, k, qo, ko, cos, sin, t, hq, k.shape[1],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        cb, cos.stride(1), sb, sin.stride(1),
        BACKWARD=backward, BLOCK_HEADS=block_heads, HALF=half, BLOCK_HALF=block_half,
        num_warps=4, enable_fp_fusion=False)  # no FMA: HF rounds every product on its own
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton rotation (``q``/``k`` ``[B, H, T, D]``, ``cos``/``sin``
    ``[B or 1, T, D]``); ``cos``/``sin`` get no gradient."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_launch(gq, gk, cos, sin, backward=True)
        return dq, dk, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` (module docstring): the Triton kernel where
    ``kernel_applies``, else ``rope_reference``."""
    if kernel_applies(q, k, cos, sin):
        return RoPEFunction.apply(q, k, cos, sin)
    return rope_reference(q, k, cos, sin)

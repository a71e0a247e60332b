"""Fused RMSNorm: Triton on CUDA (``RMSNormFunction``), ``reference.py`` elsewhere.

``rms_norm(x, weight, eps)`` computes HF's ``weight * (x.float() * rsqrt(mean(x.float()^2) +
eps)).to(x.dtype)`` for ``x`` ``[..., H]`` and ``weight`` ``[H]`` and is differentiable in both.
On CUDA the forward is one launch and the backward two: ``dx`` plus per-program partial sums of
``dw`` in one, the sum of those partials (in ``weight``'s dtype) in the other; HF's module runs
~8 ops forward and ~12 backward. The forward saves ``x`` and an fp32 ``rstd`` per row (HF's graph
keeps fp32 copies of the whole activation).

Inputs: any strides (rows that cannot be viewed with a unit column stride are copied once);
dtypes float32 / bfloat16 / float16 for ``x`` and ``weight``; ``H <= MAX_H``. Anything else (CPU
tensors, float64, a wider row) goes through ``rms_norm_reference``, the same math in torch ops.
"""
from __future__ import annotations

import functools

import torch

from .reference import rms_norm_reference

MAX_H = 16384  # widest row one program holds in registers (Llama-405B: 16384)
TILE = 4096  # elements per program tile (forward); rows per tile = TILE // next_pow2(H)
BWD_TILE = 2048  # the backward holds dy, x and their products: half the forward's tile
PROGS_PER_SM = 4  # backward programs per SM (each keeps one fp32 partial row of dw)
COL_BLOCK = 64  # columns per program of the dw partial-row sum
KERNEL_ON_CPU = False  # tests: the Triton path for CPU tensors too (TRITON_INTERPRET=1)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _warps(elements: int) -> int:
    return 4 if elements <= 4096 else 8 if elements <= 16384 else 16


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter on CPU: a few programs, so the partial sums are exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``rms_norm`` runs the Triton kernels for these tensors (else the reference)."""
    return ((x.is_cuda or KERNEL_ON_CPU) and x.device == weight.device
            and x.dtype in _DTYPES and weight.dtype in _DTYPES and x.dim() >= 1
            and weight.dim() == 1 and weight.stride(0) == 1 and x.shape[-1] == weight.shape[0]
            and 0 < weight.shape[0] <= MAX_H)


def _rows(t: torch.Tensor, h: int) -> torch.Tensor:
    """``t`` as ``[rows, h]`` with unit column stride (a view when the strides allow it)."""
    t2 = t.reshape(-1, h)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """Launch the forward: -> ``(y [rows, H], rstd [rows] fp32, x2 [rows, H])``."""
    from .kernel import _rms_norm_fwd_kernel

    h = weight.shape[0]
    x2 = _rows(x, h)
    n = x2.shape[0]
    y = torch.empty((n, h), device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    rstd = torch.empty(n, device=x.device, dtype=torch.float32)
    if n:
        block_h = _next_pow2(h)
        block_r = max(1, TILE // block_h)
        _rms_norm_fwd_kernel[(_cdiv(n, block_r),)](
            x2, weight, y, rstd, n, h, x2.stride(0), y.stride(0), 1.0 / h, float(eps),
            BLOCK_R=block_r, BLOCK_H=block_h, num_warps=_warps(block_r * block_h))
    return y, rstd, x2


def rms_norm_backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor, need_dw: bool):
    """Launch the backward: -> ``(dx [rows, H] in x's dtype, dw [H] in weight's dtype | None)``."""
    from .kernel import _col_sum_kernel, _rms_norm_bwd_kernel

    n, h = x2.shape
    dy2 = _rows(dy, h)
    dx = torch.empty((n, h), device=x2.device, dtype=x2.dtype)
    block_h = _next_pow2(h)
    block_r = max(1, BWD_TILE // block_h)
    tiles = _cdiv(n, block_r)
    progs = max(1, min(tiles, _sm_count(x2.device) * PROGS_PER_SM))
    rows_per_prog = _cdiv(tiles, progs) * block_r
    progs = _cdiv(n, rows_per_prog) if n else 1
    partial = (torch.empty((progs, h), device=x2.device, dtype=torch.float32) if need_dw
               else rstd)
    if n:
        _rms_norm_bwd_kernel[(progs,)](
            dy2, x2, weight, rstd, dx, partial, n, h, dy2.stride(0), x2.stride(0), dx.stride(0),
            1.0 / h, rows_per_prog, HAS_DW=need_dw, BLOCK_R=block_r, BLOCK_H=block_h,
            num_warps=_warps(block_r * block_h))
    if not need_dw:
        return dx, None
    dw = torch.empty(h, device=x2.device, dtype=weight.dtype)
    if not n:
        return dx, dw.zero_()
    # narrow column blocks: several programs share the (up to SMs x PROGS_PER_SM)-row sum
    _col_sum_kernel[(_cdiv(h, COL_BLOCK),)](partial, dw, progs, h, BLOCK_P=32, BLOCK_H=COL_BLOCK,
                                            num_warps=4)
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton forward/backward (``x`` ``[..., H]``, ``weight`` ``[H]``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd, x2 = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = rms_norm_backward(dy, x2, weight, rstd, need_dw)
        return (dx.view(ctx.x_shape) if need_dx else None), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of ``x`` ``[..., H]`` with ``weight`` ``[H]`` (module docstring): the Triton
    kernels where ``kernel_applies``, else ``rms_norm_reference``. Differentiable in both."""
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"rms_norm needs a number eps >= 0, got {eps!r}")
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm needs x [..., H] and weight [H]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if not kernel_applies(x, weight):
        return rms_norm_reference(x, weight, eps)
    return RMSNormFunction.apply(x, weight, float(eps))

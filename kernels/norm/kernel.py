"""Triton kernels of the fused RMSNorm (launched by ``op.py``).

``_rms_norm_fwd_kernel``: a tile of ``BLOCK_R`` rows per program; per row the fp32 sum of
squares, ``rstd = rsqrt(sum * inv_h + eps)``, ``y = w * round_in(x * rstd)`` rounded to the output
dtype; ``rstd`` is kept for the backward. ``_rms_norm_bwd_kernel``: each program walks its own
run of rows: ``dx`` row by row, and its partial ``sum_rows round_out(dy * round_in(x * rstd))``
of the weight gradient in fp32 (one row of ``DWP`` per program); ``_col_sum_kernel`` adds those
partial rows into ``dw`` in the weight's dtype. Every rounding HF's autograd graph makes (the
normalised row to the input dtype, ``dy * w`` to the output dtype and then the input dtype,
``dy * h`` to the output dtype) is made here at the same point, so only fp32 evaluation order
differs from HF's: the order of the sums, and ``dx = rstd * g - x * (rstd^3 * (g . x) / H)`` as
one expression (HF's autograd forms the same terms node by node).
"""
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (to nearest, ties to even) and returned in ``dtype``.
    bf16 is rounded on the bits: the same result as the GPU's conversion, and also under
    ``TRITON_INTERPRET=1``, whose own fp32 -> bf16 conversion truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        up = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000  # keep a NaN's top bits (adding could carry it
        out = tl.where(nan, (bits >> 16) | 0x40, up).to(tl.uint16)  # into another value)
        return out.to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, n_rows, H, s_x, s_y, inv_h, eps,
                         BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < H)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * s_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_h + eps)
    h = _round(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
    tl.store(Y + r64 * s_y + cols[None, :], _round(w[None, :] * h, Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DWP, n_rows, H, s_dy, s_x, s_dx, inv_h,
                         rows_per_prog, HAS_DW: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    start = pid * rows_per_prog
    for r0 in range(start, start + rows_per_prog, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        dy = tl.load(DY + r64 * s_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + r64 * s_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)[:, None]
        if HAS_DW:
            h = _round(x * rstd, X.dtype.element_ty).to(tl.float32)
            dw += tl.sum(_round(dy * h, DY.dtype.element_ty).to(tl.float32), axis=0)
        # d(round_in(h)) = round_in(round_out(dy * w)); then through x * rsqrt(mean(x^2) + eps)
        g = _round(_round(dy * w[None, :], DY.dtype.element_ty).to(tl.float32), X.dtype.element_ty)
        g = g.to(tl.float32)
        dot = tl.sum(g * x, axis=1)[:, None]
        dx = rstd * g - x * (rstd * rstd * rstd * dot * inv_h)
        tl.store(DX + r64 * s_dx + cols[None, :], _round(dx, DX.dtype.element_ty), mask=mask)
    if HAS_DW:
        tl.store(DWP + pid.to(tl.int64) * H + cols, dw, mask=cmask)


@triton.jit
def _col_sum_kernel(P, OUT, n_parts, H, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & cmask[None, :]
        acc += tl.sum(tl.load(P + parts.to(tl.int64)[:, None] * H + cols[None, :], mask=mask,
                              other=0.0), axis=0)
    tl.store(OUT + cols, _round(acc, OUT.dtype.element_ty), mask=cmask)

"""Triton kernel of split ZoRRo attention: the exact log-sum-exp combine of partials.

One program per token merges its (at most K) partial rows for all heads at once, in fp32, and
writes the output once: ``out = sum_k exp(lse_k - lse) * o_k`` with ``lse = logsumexp_k lse_k``.
Without LSEs it sums the rows (the query-gradient combine of the backward pass).
"""
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(parts, lse_parts, src, out, lse_out, K, H, D,
                    s_pr, s_ph, s_lh, s_src, s_or, s_oh, s_loh,
                    HAS_LSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hm = h < H
    m2 = hm[:, None] & (d[None, :] < D)
    offs = h[:, None] * s_ph + d[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if HAS_LSE:
        top = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for j in range(K):
            r = tl.load(src + t * s_src + j).to(tl.int64) + h * 0   # one row id per head lane
            lse = tl.load(lse_parts + h * s_lh + r, mask=hm & (r >= 0), other=float("-inf"))
            top = tl.maximum(top, lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(K):
            r = tl.load(src + t * s_src + j).to(tl.int64) + h * 0
            ok = hm & (r >= 0)
            lse = tl.load(lse_parts + h * s_lh + r, mask=ok, other=float("-inf"))
            w = tl.exp(lse - top)
            o = tl.load(parts + r[:, None] * s_pr + offs, mask=m2 & ok[:, None], other=0.0).to(tl.float32)
            acc += w[:, None] * o
            total += w
        inv = tl.where(total > 0, 1.0 / total, 0.0)
        acc = acc * inv[:, None]
        tl.store(lse_out + h * s_loh + t, tl.where(total > 0, top + tl.log(total), float("-inf")), mask=hm)
    else:
        for j in range(K):
            r = tl.load(src + t * s_src + j).to(tl.int64) + h * 0
            ok = m2 & (r >= 0)[:, None]
            acc += tl.load(parts + r[:, None] * s_pr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + t * s_or + h[:, None] * s_oh + d[None, :], acc.to(out.dtype.element_ty), mask=m2)

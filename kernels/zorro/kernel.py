"""Triton kernel of split ZoRRo attention: the exact log-sum-exp combine of partials.

One program per token merges its (at most K) partial rows for all heads at once, in fp32, and
writes the output once: ``out = sum_k exp(lse_k - lse) * o_k`` with ``lse = logsumexp_k lse_k``.
Without LSEs it sums the rows (the query-gradient combine of the backward pass; with one source
per token, the key/value-gradient gather). The partials stay in the tensors the attention calls
returned: ``tab [P, 5]`` holds each part's address and strides (``ptr, row stride, head
stride, lse ptr, lse head stride``, in elements), and ``src [T, K]`` packs ``part << 32 | row``
(``-1`` = no partial), so nothing is concatenated first.
"""
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(tab, src, out, lse_out, K, H, D, s_src, s_or, s_oh, s_loh,
                    HAS_LSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hm = h < H
    m2 = hm[:, None] & (d[None, :] < D)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if HAS_LSE:
        top = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for j in range(K):
            code = tl.load(src + t * s_src + j)
            if code >= 0:
                part, row = code >> 32, code & 0xFFFFFFFF
                lse_ptr = tl.load(tab + part * 5 + 3).to(tl.pointer_type(tl.float32))
                lse = tl.load(lse_ptr + h * tl.load(tab + part * 5 + 4) + row, mask=hm,
                              other=float("-inf"))
                top = tl.maximum(top, lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(K):
            code = tl.load(src + t * s_src + j)
            if code >= 0:
                part, row = code >> 32, code & 0xFFFFFFFF
                base = tl.load(tab + part * 5).to(tl.pointer_type(out.dtype.element_ty))
                lse_ptr = tl.load(tab + part * 5 + 3).to(tl.pointer_type(tl.float32))
                lse = tl.load(lse_ptr + h * tl.load(tab + part * 5 + 4) + row, mask=hm,
                              other=float("-inf"))
                w = tl.exp(lse - top)
                offs = row * tl.load(tab + part * 5 + 1) + h[:, None] * tl.load(tab + part * 5 + 2) + d[None, :]
                acc += w[:, None] * tl.load(base + offs, mask=m2, other=0.0).to(tl.float32)
                total += w
        inv = tl.where(total > 0, 1.0 / total, 0.0)
        acc = acc * inv[:, None]
        tl.store(lse_out + h * s_loh + t, tl.where(total > 0, top + tl.log(total), float("-inf")), mask=hm)
    else:
        for j in range(K):
            code = tl.load(src + t * s_src + j)
            if code >= 0:
                part, row = code >> 32, code & 0xFFFFFFFF
                base = tl.load(tab + part * 5).to(tl.pointer_type(out.dtype.element_ty))
                offs = row * tl.load(tab + part * 5 + 1) + h[:, None] * tl.load(tab + part * 5 + 2) + d[None, :]
                acc += tl.load(base + offs, mask=m2, other=0.0).to(tl.float32)
    tl.store(out + t * s_or + h[:, None] * s_oh + d[None, :], acc.to(out.dtype.element_ty), mask=m2)

"""Triton kernel of the fused rotary embedding (launched by ``op.py``).

``_rope_kernel``: one program per token ``(b, t)`` rotates every head of ``q`` and of ``k`` at
that token (one launch for both), reading the token's ``cos``/``sin`` row once. With ``x1, x2``
the halves of a head and ``c1, c2, s1, s2`` those of ``cos``/``sin``, HF's ``x * cos +
rotate_half(x) * sin`` is ``(x1 c1 - x2 s1, x2 c2 + x1 s2)``; its gradient is ``(g1 c1 + g2 s2,
g2 c2 - g1 s1)`` (``BACKWARD``). Each product and each sum is rounded to the tensors' dtype
where HF's ops (and its autograd) round them, and the launcher turns off fp contraction (no
FMA): every result is one product or one sum of two rounded products, so the kernel equals HF
bit for bit in every dtype.
"""
import triton
import triton.language as tl

from ..norm.kernel import _round


@triton.jit
def _rotate_heads(X, OUT, s_xh, s_oh, n_heads, c1, c2, s_a, s_b, BACKWARD: tl.constexpr,
                  BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    dt = OUT.dtype.element_ty
    for h0 in range(0, n_heads, BLOCK_HEADS):
        hh = (h0 + heads).to(tl.int64)
        mask = (h0 + heads < n_heads)[:, None] & (cols < HALF)[None, :]
        xp = X + hh[:, None] * s_xh + cols[None, :]
        x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
        a1 = _round(x1 * c1[None, :], dt).to(tl.float32)
        a2 = _round(x2 * c2[None, :], dt).to(tl.float32)
        if BACKWARD:  # (g1 c1 + g2 s2, g2 c2 - g1 s1)
            b1 = _round(x2 * s_a[None, :], dt).to(tl.float32)
            b2 = -_round(x1 * s_b[None, :], dt).to(tl.float32)
        else:  # (x1 c1 - x2 s1, x2 c2 + x1 s2)
            b1 = -_round(x2 * s_a[None, :], dt).to(tl.float32)
            b2 = _round(x1 * s_b[None, :], dt).to(tl.float32)
        op = OUT + hh[:, None] * s_oh + cols[None, :]
        tl.store(op, _round(a1 + b1, dt), mask=mask)
        tl.store(op + HALF, _round(a2 + b2, dt), mask=mask)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, T, HQ, HK,
                 s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_qob, s_qoh, s_qot, s_kob, s_koh, s_kot,
                 s_cb, s_ct, s_sb, s_st,
                 BACKWARD: tl.constexpr, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // T, pid % T
    cols = tl.arange(0, BLOCK_HALF)
    cm = cols < HALF
    cp = COS + b * s_cb + t * s_ct + cols
    sp = SIN + b * s_sb + t * s_st + cols
    c1 = tl.load(cp, mask=cm, other=0.0).to(tl.float32)
    c2 = tl.load(cp + HALF, mask=cm, other=0.0).to(tl.float32)
    s1 = tl.load(sp, mask=cm, other=0.0).to(tl.float32)
    s2 = tl.load(sp + HALF, mask=cm, other=0.0).to(tl.float32)
    if BACKWARD:
        s_a, s_b = s2, s1
    else:
        s_a, s_b = s1, s2
    _rotate_heads(Q + b * s_qb + t * s_qt, QO + b * s_qob + t * s_qot, s_qh, s_qoh, HQ,
                  c1, c2, s_a, s_b, BACKWARD, BLOCK_HEADS, HALF, BLOCK_HALF)
    _rotate_heads(K + b * s_kb + t * s_kt, KO + b * s_kob + t * s_kot, s_kh, s_koh, HK,
                  c1, c2, s_a, s_b, BACKWARD, BLOCK_HEADS, HALF, BLOCK_HALF)

"""Triton kernels of the LM head's token statistics: one pass over a chunk of logits each.

``_row_stats_kernel``: per row, online log-sum-exp over the vocabulary (and ``sum p*z`` for the
entropy) -> ``lse``, ``logp[target]``, entropy. ``_logit_grad_kernel``: per row, the gradient of
``g_lp * logp[target] + g_ent * entropy`` w.r.t. the logits, written over the logits in place.
Logits are read in their own dtype (bf16 from the head GEMM) and every sum runs in fp32.
"""
import triton
import triton.language as tl


@triton.jit
def _row_stats_kernel(logits, target, logp_out, lse_out, ent_out, V, s_row, inv_t,
                      WANT_ENT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * s_row
    cols = tl.arange(0, BLOCK_V)
    top = tl.full([BLOCK_V], float("-inf"), tl.float32)     # per-lane running max
    total = tl.zeros([BLOCK_V], dtype=tl.float32)            # per-lane sum exp(z - top)
    zsum = tl.zeros([BLOCK_V], dtype=tl.float32)             # per-lane sum exp(z - top) * z
    for start in range(0, V, BLOCK_V):
        ok = start + cols < V
        z = tl.load(base + start + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        new = tl.maximum(top, z)
        safe = tl.where(new == float("-inf"), 0.0, new)
        scale = tl.exp(top - safe)
        e = tl.exp(z - safe)
        total = total * scale + e
        if WANT_ENT:
            zsum = zsum * scale + tl.where(ok, e * z, 0.0)
        top = new
    m = tl.max(top, 0)
    w = tl.exp(top - m)
    s = tl.sum(total * w, 0)
    lse = m + tl.log(s)
    t = tl.load(target + row)
    z_t = tl.load(base + t).to(tl.float32) * inv_t
    tl.store(lse_out + row, lse)
    tl.store(logp_out + row, z_t - lse)
    if WANT_ENT:
        tl.store(ent_out + row, lse - tl.sum(zsum * w, 0) / s)


@triton.jit
def _logit_grad_kernel(logits, target, lse, ent, g_lp, g_ent, V, s_row, inv_t,
                       HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * s_row
    cols = tl.arange(0, BLOCK_V)
    l_row = tl.load(lse + row)
    g = tl.load(g_lp + row)
    t = tl.load(target + row)
    if HAS_ENT:
        h_row = tl.load(ent + row)
        ge = tl.load(g_ent + row)
    for start in range(0, V, BLOCK_V):
        ok = start + cols < V
        logp = tl.load(base + start + cols, mask=ok, other=0.0).to(tl.float32) * inv_t - l_row
        p = tl.exp(logp)
        if HAS_ENT:
            dz = -p * (g + ge * (logp + h_row))
        else:
            dz = -p * g
        dz = tl.where(start + cols == t, dz + g, dz) * inv_t
        tl.store(base + start + cols, dz.to(logits.dtype.element_ty), mask=ok)

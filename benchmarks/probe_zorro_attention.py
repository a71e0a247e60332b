"""Attention of one ZoRRo group, three ways, fwd + bwd of one layer (CUDA only).

    python benchmarks/probe_zorro_attention.py [--P 4096 --R 512 --G 8]

Layout: a prompt of P tokens, then G responses of R tokens; a response sees the whole prompt and
its own past. Candidates, each checked against FlexAttention (the path ``compute_logprobs`` uses)
on the same random inputs:

- ``flex``: FlexAttention with the block mask (reference and baseline);
- ``fa2-varlen``: three varlen FlashAttention-2 calls (prompt causal; responses -> prompt;
  responses causal), the response parts merged by log-sum-exp; the backward of every part is run
  with the *merged* output and LSE, which makes it exact (ring attention's trick);
- ``cudnn-dense``: the same split with dense cuDNN calls (responses batched per group), K/V heads
  expanded for the GQA-less cuDNN op.

Prints max |difference| to flex for out/dq/dk/dv, and the median time (CUDA events) and TFLOP/s
(fwd 4·pairs·D·H, bwd 2.5× that). Dense causal SDPA on the naive layout is printed for scale.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import cuda_median_ms, median  # noqa: E402

A = torch.ops.aten


def bench(fn, n: int = 15) -> float:
    return median(cuda_median_ms(fn, warmup=3, iters=n))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--P", type=int, default=4096)
    ap.add_argument("--R", type=int, default=512)
    ap.add_argument("--G", type=int, default=8)
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    P, R, G = args.P, args.R, args.G
    H, HK, D = 16, 8, 128
    dev, dt = "cuda", torch.bfloat16
    T, sc, rep = P + G * R, 1 / math.sqrt(D), H // HK
    torch.manual_seed(0)
    q = torch.randn(1, H, T, D, device=dev, dtype=dt)
    k = torch.randn(1, HK, T, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    seg = torch.full((T,), -1, device=dev, dtype=torch.int32)
    for g in range(G):
        seg[P + g * R: P + (g + 1) * R] = g
    bm = create_block_mask(lambda b, h, i, j: (j <= i) & ((seg[j] < 0) | (seg[j] == seg[i])),
                           1, 1, T, T, device=dev)
    flex = torch.compile(flex_attention)

    def run_flex():
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = flex(qq, kk, vv, block_mask=bm, scale=sc, enable_gqa=True)
        o.backward(do)
        return o, qq.grad, kk.grad, vv.grad

    def merge(o2, l2, o3, l3):
        lse = torch.logaddexp(l2, l3)
        o = o2.float() * (l2 - lse).exp()[..., None] + o3.float() * (l3 - lse).exp()[..., None]
        return o.to(dt), lse

    # ---- FA-2 varlen: tensors [tokens, heads, D], LSE [heads, tokens]
    i32 = dict(device=dev, dtype=torch.int32)
    cp, cr_all = torch.tensor([0, P], **i32), torch.tensor([0, G * R], **i32)
    cr = torch.arange(0, G * R + 1, R, **i32)

    def fa(qs, ks, vs, cq, ck, mq, mk, causal):
        return A._flash_attention_forward(qs, ks, vs, cq, ck, mq, mk, 0.0, causal, False, scale=sc)[:4]

    def fab(dos, qs, ks, vs, o, lse, cq, ck, mq, mk, causal, r):
        return A._flash_attention_backward(dos, qs, ks, vs, o, lse, cq, ck, mq, mk, 0.0, causal,
                                           r[2], r[3], scale=sc)

    def run_fa2():
        qt, kt, vt, dot = (x[0].transpose(0, 1).contiguous() for x in (q, k, v, do))
        r1 = fa(qt[:P], kt[:P], vt[:P], cp, cp, P, P, True)
        r2 = fa(qt[P:], kt[:P], vt[:P], cr_all, cp, G * R, P, False)
        r3 = fa(qt[P:], kt[P:], vt[P:], cr, cr, R, R, True)
        o_r, lse = merge(r2[0].transpose(0, 1), r2[1], r3[0].transpose(0, 1), r3[1])
        o_r = o_r.transpose(0, 1).contiguous()
        d1 = fab(dot[:P], qt[:P], kt[:P], vt[:P], r1[0], r1[1], cp, cp, P, P, True, r1)
        d2 = fab(dot[P:], qt[P:], kt[:P], vt[:P], o_r, lse, cr_all, cp, G * R, P, False, r2)
        d3 = fab(dot[P:], qt[P:], kt[P:], vt[P:], o_r, lse, cr, cr, R, R, True, r3)
        back = (lambda x: x.transpose(0, 1)[None])
        return (back(torch.cat([r1[0], o_r])), back(torch.cat([d1[0], d2[0] + d3[0]])),
                back(torch.cat([d1[1] + d2[1], d3[1]])), back(torch.cat([d1[2] + d2[2], d3[2]])))

    # ---- cuDNN dense: [batch, heads, L, D], LSE [batch, heads, L, 1]
    def cf(q_, k_, v_, causal):
        return A._scaled_dot_product_cudnn_attention(q_, k_, v_, None, True, 0.0, causal, False, scale=sc)

    def cb(r, do_, q_, k_, v_, o_, lse_, causal):
        return A._scaled_dot_product_cudnn_attention_backward(
            do_, q_, k_, v_, o_, lse_, r[6], r[7], None, r[2], r[3], r[4], r[5], 0.0, causal, scale=sc)

    def per_group(x):  # [1, h, G*R, D] -> [G, h, R, D]
        return x.reshape(1, x.shape[1], G, R, -1)[0].transpose(0, 1).contiguous()

    def joined(x):  # inverse of per_group
        return x.transpose(0, 1).reshape(1, x.shape[1], G * R, -1)

    def run_cudnn():
        ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        qp, kp, vp = (x[:, :, :P].contiguous() for x in (q, ke, ve))
        qr = q[:, :, P:].contiguous()
        qg, kg, vg = per_group(qr), per_group(ke[:, :, P:]), per_group(ve[:, :, P:])
        r1, r2, r3 = cf(qp, kp, vp, True), cf(qr, kp, vp, False), cf(qg, kg, vg, True)
        flat = (lambda t: t.reshape(t.shape[0], t.shape[1], -1, 1))  # LSE [b, h, L] or [b, h, L, 1]
        o_r, lse = merge(r2[0], flat(r2[1])[..., 0], joined(r3[0]), joined(flat(r3[1]))[..., 0])
        do_r = do[:, :, P:].contiguous()
        d1 = cb(r1, do[:, :, :P].contiguous(), qp, kp, vp, r1[0], r1[1], True)
        d2 = cb(r2, do_r, qr, kp, vp, o_r, lse.reshape(r2[1].shape).contiguous(), False)
        d3 = cb(r3, per_group(do_r), qg, kg, vg, per_group(o_r),
                per_group(lse[..., None]).reshape(r3[1].shape), True)
        red = (lambda x: x.reshape(1, HK, rep, T, D).sum(2))
        return (torch.cat([r1[0], o_r], 2), torch.cat([d1[0], d2[0] + joined(d3[0])], 2),
                red(torch.cat([d1[1] + d2[1], joined(d3[1])], 2)),
                red(torch.cat([d1[2] + d2[2], joined(d3[2])], 2)))

    pairs = P * P / 2 + G * (R * P + R * R / 2)
    tflop = 3.5 * 4 * pairs * D * H / 1e12
    want = run_flex()
    print(f"P{P}/R{R}/G{G}, H{H}/{HK}, D{D}, bf16: {tflop:.3f} TFLOP fwd+bwd per layer")
    print("| path | max abs diff o / dq / dk / dv vs flex | fwd+bwd ms | TFLOP/s |")
    print("|---|---|---|---|")
    for name, fn in (("flex", run_flex), ("fa2-varlen", run_fa2), ("cudnn-dense", run_cudnn)):
        try:
            got = fn()
            diff = " / ".join(f"{(a.float() - b.float()).abs().max().item():.4f}" for a, b in zip(got, want))
            ms = bench(fn)
            print(f"| {name} | {diff} | {ms:.3f} | {tflop / ms * 1e3:.0f} |", flush=True)
        except Exception as exc:  # a backend this torch build lacks
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | | |", flush=True)
    qn = torch.randn(G, H, P + R, D, device=dev, dtype=dt, requires_grad=True)
    kn = torch.randn(G, HK, P + R, D, device=dev, dtype=dt, requires_grad=True)
    vn = torch.randn_like(kn, requires_grad=True)
    don = torch.randn(G, H, P + R, D, device=dev, dtype=dt)
    ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        qn, kn, vn, is_causal=True, enable_gqa=True).backward(don))
    naive = 3.5 * 4 * G * (P + R) ** 2 / 2 * D * H / 1e12
    print(f"naive layout, dense causal SDPA: {ms:.3f} ms, {naive / ms * 1e3:.0f} TFLOP/s")


if __name__ == "__main__":
    main()

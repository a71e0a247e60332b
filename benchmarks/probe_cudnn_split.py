"""cuDNN facts behind split ZoRRo attention (CUDA only), one mode per run:

    python benchmarks/probe_cudnn_split.py check      # top-left causal Lq > Lk, native GQA, backward
    python benchmarks/probe_cudnn_split.py newshape   # first-call cost of new shapes (plan builds)
    TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 python benchmarks/probe_cudnn_split.py newshape
    python benchmarks/probe_cudnn_split.py timing     # per-call fwd / bwd at P4096/R512/G8

``timing`` compares, for one prompt group, the per-prompt cuDNN call (queries = prompt and its
responses, keys = prompt, top-left causal, strided views), the responses' own causal attention
(cuDNN batched vs FlashAttention-2 varlen) and FlexAttention over the whole group. Results are
in BENCHMARKS.md (ZoRRo section)."""
import math, os, sys, time, subprocess
import torch
A = torch.ops.aten
dev, dt = "cuda", torch.bfloat16
H, HK, D = 16, 8, 128
sc = 1 / math.sqrt(D)

def ref(q, k, v, causal):  # [1,H,Lq,D], k [1,HK,Lk,D]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    s = q.float() @ k.transpose(-1, -2) * sc
    if causal:
        Lq, Lk = s.shape[-2:]
        m = torch.arange(Lk, device=dev)[None] <= torch.arange(Lq, device=dev)[:, None]
        s = s.masked_fill(~m, float("-inf"))
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp() @ v, lse

def cf(q, k, v, causal):
    return A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=sc)

def cb(r, do, q, k, v, o, lse, causal):
    return A._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse, r[6], r[7], None, r[2], r[3], r[4], r[5], 0.0, causal, scale=sc)

def t(fn, n=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record(); fn(); b.record()
        torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

def check():
    torch.manual_seed(0)
    Lk, Lq = 300, 1000
    base = torch.randn(Lq, H + 2 * HK, D, device=dev, dtype=dt)  # BSHD token-major, views
    q = base[:, :H].unsqueeze(0).transpose(1, 2)
    k = base[:Lk, H:H + HK].unsqueeze(0).transpose(1, 2)
    v = base[:Lk, H + HK:].unsqueeze(0).transpose(1, 2)
    o_ref, lse_ref = ref(q, k, v, True)
    for name, kk, vv in (("gqa-native", k, v), ("expanded", k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))):
        try:
            r = cf(q, kk, vv, True)
            print(name, "out", tuple(r[0].shape), r[0].stride(), "lse", tuple(r[1].shape), r[1].stride(), r[1].dtype)
            print(name, "fwd err o", (r[0].float() - o_ref).abs().max().item(), "lse", (r[1].reshape(lse_ref.shape) - lse_ref).abs().max().item())
            # backward with *given* O/LSE (the reference's, not cuDNN's)
            do = torch.randn_like(r[0])
            qq, k2, v2 = (x.detach().float().requires_grad_() for x in (q, k, v))
            o2, _ = ref(qq, k2, v2, True); o2.backward(do.float())
            g = cb(r, do, q, kk, vv, r[0], r[1], True)
            print(name, "dq", tuple(g[0].shape), "dk", tuple(g[1].shape))
            dk = g[1] if g[1].shape[1] == HK else g[1].reshape(1, HK, 2, Lk, D).sum(2)
            dv = g[2] if g[2].shape[1] == HK else g[2].reshape(1, HK, 2, Lk, D).sum(2)
            print(name, "bwd err dq", (g[0].float() - qq.grad).abs().max().item(), "dk", (dk.float() - k2.grad).abs().max().item(),
                  "dv", (dv.float() - v2.grad).abs().max().item(), "scale", qq.grad.abs().max().item())
        except Exception as e:
            print(name, "FAILED", type(e).__name__, str(e)[:300])

def newshape():
    torch.manual_seed(0)
    res = []
    for i, P in enumerate([4000, 4001, 4033, 3900, 4000, 1000, 257]):
        Lq = P + 8 * 512
        q = torch.randn(1, Lq, H, D, device=dev, dtype=dt).transpose(1, 2); k = torch.randn(1, P, HK, D, device=dev, dtype=dt).transpose(1, 2); v = torch.randn(1, P, HK, D, device=dev, dtype=dt).transpose(1, 2)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        r = cf(q, k, v, True); g = cb(r, torch.randn_like(r[0]), q, k, v, r[0], r[1], True)
        torch.cuda.synchronize(); res.append(f"P{P}:{(time.perf_counter() - t0) * 1e3:.0f}ms")
        if i == 0: print("out strides", r[0].stride(), "lse", tuple(r[1].shape))
        if i == 0:
            o_ref, lse_ref = ref(q, k, v, True)
            print("fwd err", (r[0].float() - o_ref).abs().max().item(), "lse err", (r[1].reshape(lse_ref.shape) - lse_ref).abs().max().item())
    print("steady fwd+bwd of the last shape: %.3f ms" % t(lambda: cb(cf(q, k, v, True), r[0], q, k, v, r[0], r[1], True)))
    print("AVOID_RECOMPILE=%s new-shape fwd+bwd first call:" % os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"), " ".join(res))

def timing():
    P, R, G = 4096, 512, 8
    T = P + G * R
    base = torch.randn(T, H + 2 * HK, D, device=dev, dtype=dt)
    qt, kt, vt = base[:, :H], base[:, H:H + HK], base[:, H + HK:]
    q = qt.unsqueeze(0).transpose(1, 2); k = kt[:P].unsqueeze(0).transpose(1, 2); v = vt[:P].unsqueeze(0).transpose(1, 2)
    r = cf(q, k, v, True); do = torch.randn_like(r[0])
    f1 = t(lambda: cf(q, k, v, True)); b1 = t(lambda: cb(r, do, q, k, v, r[0], r[1], True))
    pairs = P * P / 2 + G * R * P
    fl = 4 * pairs * D * H
    print(f"cudnn top-left [P+GR]x[P] views GQA: fwd {f1:.3f} ms {fl/f1/1e9:.0f} TF/s, bwd {b1:.3f} ms {2.5*fl/b1/1e9:.0f} TF/s")
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous(); rc = cf(qc, kc, vc, True); doc = torch.randn_like(rc[0])
    f2 = t(lambda: cf(qc, kc, vc, True)); b2 = t(lambda: cb(rc, doc, qc, kc, vc, rc[0], rc[1], True))
    print(f"cudnn top-left contiguous BHSD: fwd {f2:.3f} bwd {b2:.3f}")
    # leaves via FA-2 varlen (gathered contiguous)
    lq, lk, lv = qt[P:].contiguous(), kt[P:].contiguous(), vt[P:].contiguous()
    cu = torch.arange(0, G * R + 1, R, device=dev, dtype=torch.int32)
    fa = lambda: A._flash_attention_forward(lq, lk, lv, cu, cu, R, R, 0.0, True, False, scale=sc)
    rf = fa(); dof = torch.randn_like(rf[0])
    fab = lambda: A._flash_attention_backward(dof, lq, lk, lv, rf[0], rf[1], cu, cu, R, R, 0.0, True, rf[2], rf[3], scale=sc)
    f3, b3 = t(fa), t(fab)
    lfl = 4 * G * R * R / 2 * D * H
    print(f"fa2 varlen leaves: fwd {f3:.3f} ms {lfl/f3/1e9:.0f} TF/s bwd {b3:.3f} ms {2.5*lfl/b3/1e9:.0f}; lse {tuple(rf[1].shape)}")
    # leaves via cuDNN batched [G,H,R,D]
    bq = lq.view(G, R, H, D).transpose(1, 2); bk = lk.view(G, R, HK, D).transpose(1, 2); bv = lv.view(G, R, HK, D).transpose(1, 2)
    rb = cf(bq, bk, bv, True); dob = torch.randn_like(rb[0])
    f4, b4 = t(lambda: cf(bq, bk, bv, True)), t(lambda: cb(rb, dob, bq, bk, bv, rb[0], rb[1], True))
    print(f"cudnn batched leaves: fwd {f4:.3f} ms {lfl/f4/1e9:.0f} TF/s bwd {b4:.3f} ms {2.5*lfl/b4/1e9:.0f}")
    # flex baseline, whole group
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    seg = torch.full((T,), -1, device=dev, dtype=torch.int32)
    for g in range(G): seg[P + g * R: P + (g + 1) * R] = g
    bm = create_block_mask(lambda b, h, i, j: (j <= i) & ((seg[j] < 0) | (seg[j] == seg[i])), 1, 1, T, T, device=dev)
    flex = torch.compile(flex_attention)
    Q, K, V = (x.unsqueeze(0).transpose(1, 2).detach().requires_grad_() for x in (qt, kt, vt))
    dO = torch.randn(1, H, T, D, device=dev, dtype=dt)
    def fwd(): return flex(Q, K, V, block_mask=bm, scale=sc, enable_gqa=True)
    ff = t(fwd); o = fwd(); fb = t(lambda: torch.autograd.grad(o, (Q, K, V), dO, retain_graph=True))
    tot = fl + lfl
    print(f"flex whole group: fwd {ff:.3f} ms {tot/ff/1e9:.0f} TF/s, bwd {fb:.3f} ms {2.5*tot/fb/1e9:.0f}")
    print(f"split sum (cudnn views + fa2 leaves): fwd {f1+f3:.3f} bwd {b1+b3:.3f}; (cudnn+cudnn batched) fwd {f1+f4:.3f} bwd {b1+b4:.3f}; flex {ff:.3f} {fb:.3f}")

if __name__ == "__main__":
    what = sys.argv[1]
    print(torch.__version__, torch.backends.cudnn.version(), flush=True)
    {"check": check, "newshape": newshape, "timing": timing}[what]()

"""Probe: what fusing a decode step's projections would save (GPU; one process).

A decoder layer of the Qwen3-0.6B shape at decode batch M runs seven GEMMs (q, k, v, o, gate,
up, down). Fused, the same weights need four (qkv, o, gate_up, down): fewer launches, wider
GEMMs. This times the 28 layers' GEMM sequence both ways as one CUDA-graph replay (how the
sampler runs a decode step), plus the LM head, and reports ms per step and the fraction of HBM
the weight bytes get (cuBLAS through ``F.linear``)::

    python benchmarks/probe_decode_gemms.py [--rows 64 128] [--out $OUT]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 1024, 16, 8, 128, 3072, 28, 151936


def layer_weights(fused: bool, dev, dtype):
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=dtype) * 0.02

    if fused:
        return {"qkv": w(q + 2 * kv, HIDDEN), "o": w(HIDDEN, q), "gate_up": w(2 * INTER, HIDDEN),
                "down": w(HIDDEN, INTER)}
    return {"q": w(q, HIDDEN), "k": w(kv, HIDDEN), "v": w(kv, HIDDEN), "o": w(HIDDEN, q),
            "gate": w(INTER, HIDDEN), "up": w(INTER, HIDDEN), "down": w(HIDDEN, INTER)}


def step(layers, x, fused: bool, lin=F.linear):
    for lw in layers:
        if fused:
            qkv = lin(x, lw["qkv"])
            q = qkv[:, : HEADS * HEAD_DIM]
            h = lin(q.contiguous(), lw["o"])
            gu = lin(h, lw["gate_up"])
            g, u = gu.chunk(2, dim=-1)
            x = lin(F.silu(g) * u, lw["down"])
        else:
            q, _k, _v = lin(x, lw["q"]), lin(x, lw["k"]), lin(x, lw["v"])  # k, v: their GEMMs
            h = lin(q, lw["o"])
            x = lin(F.silu(lin(h, lw["gate"])) * lin(h, lw["up"]), lw["down"])
    return x


def time_graph(fn, iters: int = 200) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    rows = []
    for fused in (False, True):
        layers = [layer_weights(fused, dev, dtype) for _ in range(LAYERS)]
        wbytes = sum(t.numel() * t.element_size() for lw in layers for t in lw.values())
        head = torch.randn(VOCAB, HIDDEN, device=dev, dtype=dtype) * 0.02
        for m in args.rows:
            x = torch.randn(m, HIDDEN, device=dev, dtype=dtype)
            ms = time_graph(lambda ls=layers, x=x, f=fused: step(ls, x, f))
            ms_head = time_graph(lambda x=x, w=head: F.linear(x, w))
            rows.append({"fused": fused, "rows": m, "layers_ms": ms, "head_ms": ms_head,
                         "weight_GB": wbytes / 1e9, "hbm_fraction": wbytes / ms / 1e6 / 4400})
            print(json.dumps(rows[-1]), flush=True)
        layers = None  # free this arm's weights before the next
    for m in args.rows:
        a = next(r for r in rows if r["rows"] == m and not r["fused"])
        b = next(r for r in rows if r["rows"] == m and r["fused"])
        print(f"rows {m}: separate {a['layers_ms']:.3f} ms, fused {b['layers_ms']:.3f} ms, "
              f"saves {a['layers_ms'] - b['layers_ms']:.3f} ms ({a['layers_ms'] / b['layers_ms']:.2f}x)")
    if args.out:
        with open(os.path.join(args.out, "probe_decode_gemms.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

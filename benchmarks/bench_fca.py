"""FCA decode vs paged decode vs SDPA over materialised KV, side by side on one GPU.

bf16, Hq32/Hkv8/D128, page 16 (defaults). For each forest shape, in one process:
(1) SDPA over materialised KV (every request reads its own contiguous copy);
(2) our Triton paged decode without sharing, on the paged cache whose prefix pages are
physically shared (it gets real help from L2: the honest baseline), best of a small sweep;
(3) FCA (plan once per step, outside the timing; plan time reported apart): a sweep of
configs on the first shape; its winner is "FCA" on every shape (the default config and the
best of the first shape's top configs per shape are reported too).
FlashInfer's numbers quoted in issue 3 (same H200, flashinfer 0.7.2) are reported as reference.
Times: ``triton.testing.do_bench`` median (L2 flushed between runs) of a CUDA-graph replay
(how a decode step runs; eager times, with Python launch overhead, are kept too).
Unique bytes: every KV token the batch needs read once + q + out. Writes JSON + PNG under
``--out``, prints a table.

    python benchmarks/bench_fca.py --out benchmarks/results
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(__file__))
from common import H200_HBM_BYTES_PER_S, environment, markdown_table, save
from polynya.kernels.fca import DecodeConfig, fca_decode, paged_decode, plan_forest
from polynya.kernels.fca.testing import build_forest, random_kv

DEVICE = "cuda"
# name -> (levels, FlashInfer numbers quoted in issue 3: sdpa, fi_paged, fi_cascade in ms)
SHAPES = {
    "8x16 P4096 S512": ([(8, 4096), (16, 512)], (0.550, 0.300, 0.492)),
    "32x16 P4096 S512": ([(32, 4096), (16, 512)], (2.135, 1.125, 2.366)),
    "64x16 P2048 S256": ([(64, 2048), (16, 256)], (2.139, 1.172, 2.637)),
    "3-level 2048>64x512>8x512": ([(1, 2048), (64, 512), (8, 512)], (None, None, None)),
    "no sharing 128x1 T4608": ([(128, 4608)], (0.549, 0.564, 3.001)),
}
PAGED_SWEEP = [DecodeConfig(), DecodeConfig(num_stages=3), DecodeConfig(block_n=32),
               DecodeConfig(block_n=128, num_warps=8), DecodeConfig(progs_per_sm=8)]
FCA_SWEEP = [  # (plan kwargs, kernel config); entry 0 is the default
    ({}, DecodeConfig()),
    ({}, DecodeConfig(mode="fused", dynamic=False)),
    ({"chunk_tokens": 2048}, DecodeConfig(mode="fused", dynamic=False)),
    ({}, DecodeConfig(mode="fused", interleave=True)),
    ({}, DecodeConfig(mode="split")),
    ({"chunk_tokens": 512}, DecodeConfig(mode="split")),
    ({"chunk_tokens": 2048}, DecodeConfig(mode="split")),
    ({}, DecodeConfig(mode="split", shared_progs_per_sm=2)),
    ({}, DecodeConfig(mode="split", shared_num_warps=8, shared_progs_per_sm=1)),
    ({}, DecodeConfig(mode="streams")),
    ({}, DecodeConfig(mode="streams", shared_progs_per_sm=2)),
    ({}, DecodeConfig(mode="streams", shared_num_warps=8, shared_progs_per_sm=1)),
    ({"chunk_tokens": 512}, DecodeConfig(mode="streams", shared_progs_per_sm=1)),
    ({"chunk_tokens": 2048}, DecodeConfig(mode="streams", shared_progs_per_sm=1)),
    ({}, DecodeConfig(mode="streams", shared_progs_per_sm=1, block_n_shared=32)),
    ({}, DecodeConfig(mode="split", block_m_shared=32)),
    # 2026-12-02: deeper pipelining and wider tiles for the shared pass (issue 15 goal 8)
    ({}, DecodeConfig(mode="streams", shared_num_stages=3)),
    ({}, DecodeConfig(mode="streams", shared_num_stages=4)),
    ({}, DecodeConfig(mode="streams", block_n_shared=128, shared_num_warps=8)),
    ({}, DecodeConfig(mode="streams", block_n_shared=128, shared_num_warps=8, shared_num_stages=3)),
    ({"chunk_tokens": 1024}, DecodeConfig(mode="streams", shared_progs_per_sm=2)),
    ({"chunk_tokens": 1024}, DecodeConfig(mode="streams", shared_progs_per_sm=2, shared_num_stages=3)),
    ({"chunk_tokens": 4096}, DecodeConfig(mode="streams", shared_num_stages=3)),
    ({}, DecodeConfig(mode="streams", num_stages=3)),
    ({}, DecodeConfig(mode="streams", shared_num_warps=8, shared_num_stages=3)),
    ({}, DecodeConfig(mode="streams", progs_per_sm=8, shared_num_stages=3)),
]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn) -> float:
    """Median time of a CUDA-graph replay of ``fn`` (no Python launch overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def unique_bytes(bt, sl, bs, hq, hkv, d, esize) -> int:
    """KV bytes of every distinct (block, token) the batch attends to, plus q and out."""
    MB = bt.shape[1]
    used = (sl[:, None] - torch.arange(MB, device=bt.device)[None, :] * bs).clamp(0, bs)
    ids = torch.where(used > 0, bt, -1).flatten().long()
    per_block = torch.zeros(int(ids.max()) + 2, dtype=torch.long, device=bt.device)
    per_block.scatter_reduce_(0, ids + 1, used.flatten().long(), reduce="amax")
    tokens = int(per_block[1:].sum())
    return tokens * hkv * d * 2 * esize + 2 * bt.shape[0] * hq * d * esize


def materialise(k, v, bt, sl):
    """Per-request contiguous K/V ``[B, Hkv, T, D]`` (all requests of a shape share T)."""
    T = int(sl[0])
    assert bool((sl == T).all())
    B, bs = bt.shape[0], k.shape[1]
    nblk = -(-T // bs)
    kk = k[bt[:, :nblk].long()].reshape(B, nblk * bs, *k.shape[2:])[:, :T]
    vv = v[bt[:, :nblk].long()].reshape(B, nblk * bs, *v.shape[2:])[:, :T]
    return kk.transpose(1, 2).contiguous(), vv.transpose(1, 2).contiguous()


def best(fns: dict) -> tuple[str, float, dict]:
    times = {name: bench(fn) for name, fn in fns.items()}
    name = min(times, key=times.get)
    return name, times[name], times


def run_shape(name, levels, quoted, args, keep, lead):
    bs, hq, hkv, d, dtype = args.page, args.hq, args.hkv, args.d, torch.bfloat16
    bt, sl, nb = build_forest(levels, bs, seed=0, device=DEVICE)
    k, v = random_kv(nb, bs, hkv, d, dtype, DEVICE)
    q = torch.randn(bt.shape[0], hq, d, device=DEVICE, dtype=dtype)
    ub = unique_bytes(bt, sl, bs, hq, hkv, d, 2)
    row = {"shape": name, "B": bt.shape[0], "unique_MB": round(ub / 1e6, 1)}

    paged_fns = {f"paged[{i}]": (lambda c=c: paged_decode(q, k, v, bt, sl, validate=False,
                                                           config=c))
                 for i, c in enumerate(PAGED_SWEEP)}
    pname, t_paged_eager, paged_eager = best(paged_fns)
    paged_all = {n: graph_ms(f) for n, f in paged_fns.items()}
    pname = min(paged_all, key=paged_all.get)
    t_paged = paged_all[pname]
    ref = paged_decode(q, k, v, bt, sl)

    fca_fns = {}
    plans = {}
    idx = range(len(FCA_SWEEP)) if keep is None else keep
    for i in idx:
        pkw, cfg = FCA_SWEEP[i]
        key = tuple(sorted(pkw.items()))
        if key not in plans:
            plans[key] = plan_forest(bt, sl, bs, **pkw)
        plan = plans[key]
        fca_decode(q, k, v, plan, config=cfg)  # compile + bounds check once
        fca_fns[f"fca[{i}]"] = (lambda p=plan, c=cfg: fca_decode(q, k, v, p, config=c))
    _, _, fca_eager = best(fca_fns)
    fca_all = {n: graph_ms(f) for n, f in fca_fns.items()}  # decode steps run as CUDA graphs
    t_best = min(fca_all.values())
    t_fca_default = fca_all["fca[0]"]
    ranked = [int(k_[4:-1]) for k_ in sorted(fca_all, key=fca_all.get)]
    lead = ranked[0] if lead is None else lead  # the config that won the first shape
    t_fca = fca_all[f"fca[{lead}]"]
    chosen = FCA_SWEEP[lead]
    fname = f"fca[{lead}]"
    out = fca_decode(q, k, v, plan_forest(bt, sl, bs, **chosen[0]), config=chosen[1])
    err = (out.float() - ref.float()).abs().max().item()
    t_fca_eager = fca_eager[fname]
    t_paged_eager = paged_eager[pname]
    t_plan = bench(lambda: plan_forest(bt, sl, bs, validate=False, **chosen[0]))
    t_plan_graph = graph_ms(lambda: plan_forest(bt, sl, bs, validate=False, **chosen[0]))
    stats = plan_forest(bt, sl, bs, **chosen[0]).stats()

    t_sdpa = None
    if not args.no_sdpa:
        kk, vv = materialise(k, v, bt, sl)
        q4 = q[:, :, None, :]
        try:
            t_sdpa = bench(lambda: F.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True))
        except RuntimeError:  # no GQA in the chosen backend: expand the heads
            kk = kk.repeat_interleave(hq // hkv, 1)
            vv = vv.repeat_interleave(hq // hkv, 1)
            t_sdpa = bench(lambda: F.scaled_dot_product_attention(q4, kk, vv))
        del kk, vv
    torch.cuda.empty_cache()
    fi_sdpa, fi_paged, fi_cascade = quoted
    row.update({
        "sdpa_ms": r3(t_sdpa), "paged_ms": r3(t_paged), "fca_ms": r3(t_fca),
        "fca_default_ms": r3(t_fca_default), "plan_ms": r3(t_plan),
        "plan_graph_ms": r3(t_plan_graph), "fca_best_ms": r3(t_best),
        "fca_best_config": min(fca_all, key=fca_all.get),
        "fca_eager_ms": r3(t_fca_eager), "paged_eager_ms": r3(t_paged_eager),
        "fca_eager_vs_paged_eager": rx(t_paged_eager, t_fca_eager),
        "fca_vs_sdpa": rx(t_sdpa, t_fca), "fca_vs_paged": rx(t_paged, t_fca),
        "fca_vs_fi_paged": rx(fi_paged, t_fca), "fi_paged_ms_quoted": fi_paged,
        "fi_cascade_ms_quoted": fi_cascade, "sdpa_ms_quoted": fi_sdpa,
        "floor_ms": r3(ub / H200_HBM_BYTES_PER_S * 1e3),
        "fca_hbm_pct": round(100 * ub / (t_fca * 1e-3) / H200_HBM_BYTES_PER_S, 1),
        "fca_TBps": round(ub / (t_fca * 1e-3) / 1e12, 2),
        "max_abs_diff_vs_paged": round(err, 5), "paged_best": pname, "fca_best": fname,
        "fca_config": {"plan": chosen[0], "kernel": dataclasses.asdict(chosen[1])},
        "paged_sweep_graph_ms": {k_: r3(v_) for k_, v_ in paged_all.items()},
        "paged_sweep_eager_ms": {k_: r3(v_) for k_, v_ in paged_eager.items()},
        "fca_sweep_graph_ms": {k_: r3(v_) for k_, v_ in fca_all.items()},
        "fca_sweep_eager_ms": {k_: r3(v_) for k_, v_ in fca_eager.items()}, "plan_stats": stats,
    })
    return row, ranked


def r3(x):
    return None if x is None else round(x, 4)


def rx(base, t):
    return None if base is None else round(base / t, 2)


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    return 2 * x.numel() / (t * 1e-3)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["shape"] for r in rows]
    series = [("SDPA materialised", "sdpa_ms"), ("paged (ours, no sharing)", "paged_ms"),
              ("FlashInfer paged (issue, quoted)", "fi_paged_ms_quoted"), ("FCA", "fca_ms"),
              ("unique-byte floor", "floor_ms")]
    fig, ax = plt.subplots(figsize=(12, 5))
    w = 0.16
    for i, (label, key) in enumerate(series):
        vals = [r[key] or 0 for r in rows]
        ax.bar([x + i * w for x in range(len(rows))], vals, w, label=label)
    ax.set_xticks([x + 2 * w for x in range(len(rows))], names, fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title("FCA decode, H200, bf16, Hq32/Hkv8/D128, page 16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default="all", help="comma-separated indices or 'all'")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--no-sdpa", action="store_true")
    args = ap.parse_args()
    names = list(SHAPES)
    if args.shapes != "all":
        names = [names[int(i)] for i in args.shapes.split(",")]
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s", flush=True)
    rows, keep, lead = [], None, None
    for name in names:
        levels, quoted = SHAPES[name]
        row, ranked = run_shape(name, levels, quoted, args, keep, lead)
        if keep is None:
            lead = ranked[0]  # later shapes: the default, the first shape's winner, the runners-up
            per_mode = [next(i for i in ranked if FCA_SWEEP[i][1].mode == m)
                        for m in ("fused", "split", "streams")]
            keep = list(dict.fromkeys([0, ranked[0], *per_mode, *ranked[1:3]]))
        rows.append(row)
        print({k: row[k] for k in ("shape", "sdpa_ms", "paged_ms", "fca_ms", "fca_default_ms",
                                   "fca_best_ms", "fca_best_config", "fca_eager_ms",
                                   "paged_eager_ms", "plan_ms", "plan_graph_ms", "fca_hbm_pct",
                                   "max_abs_diff_vs_paged", "fca_best", "paged_best")},
              flush=True)
        for key in ("fca_sweep_graph_ms", "fca_sweep_eager_ms", "paged_sweep_graph_ms",
                    "paged_sweep_eager_ms"):
            print(f"  {key}:", row[key], flush=True)
    result = {"env": environment(), "copy_TBps": round(bw / 1e12, 3), "rows": rows}
    path = save(result, args.out, "bench_fca")
    plot(rows, os.path.join(args.out, "bench_fca.png"))
    cols = [("shape", "shape"), ("sdpa_ms", "SDPA mat. ms"), ("paged_ms", "paged ms"),
            ("fi_paged_ms_quoted", "FI paged ms (issue)"), ("fca_ms", "FCA ms"),
            ("floor_ms", "floor ms"), ("fca_vs_sdpa", "x SDPA"), ("fca_vs_paged", "x paged"),
            ("fca_vs_fi_paged", "x FI paged"), ("fca_hbm_pct", "% HBM (unique)"),
            ("fca_eager_ms", "FCA eager ms"), ("paged_eager_ms", "paged eager ms"),
            ("fca_best_ms", "FCA best-of-sweep ms"), ("plan_ms", "plan ms"),
            ("plan_graph_ms", "plan graph ms")]
    print(markdown_table(rows, cols))
    print("json:", path)


if __name__ == "__main__":
    main()

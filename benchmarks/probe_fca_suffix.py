"""FCA decode through a generation: the shared pass when the private suffixes are still short.

``bench_fca.py`` times FCA at the end of a generation (S512: every row's own 512 tokens read
by the paged kernel while the shared pass runs beside it on a side stream). A sampler's decode
steps walk S from 1 to 512, so most steps have little private work to hide the shared pass
behind. This probe times one decode call (CUDA-graph replay, ``do_bench`` median, L2 flushed)
at the sampler's shape (8 prompts of 4096 tokens x G16, Hq16/Hkv8/D128 = Qwen3-0.6B, page 16)
for several suffix lengths S and a few plan / launch configurations, against the paged kernel
on the same cache, and reports ms, % of HBM on unique bytes and the step-weighted mean over S
(the mean a 512-token generation sees). It also times the forest plan itself (CUDA-graph replay),
built as the sampler builds it, from tables ``--table-width`` columns wide (the sampler's graphs
pass ``max_model_len / page`` columns: 2560 for Qwen3-0.6B), with ``backend="torch"`` (~50
torch ops, the oracle) and ``backend="triton"`` (four Triton launches, the default on CUDA),
after checking the two plans are equal::

    python benchmarks/probe_fca_suffix.py --out $OUT            # H200, ~1-2 min
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_fca import graph_ms, unique_bytes  # noqa: E402
from common import H200_HBM_BYTES_PER_S, environment, save  # noqa: E402
from polynya.kernels.fca import DecodeConfig, fca_decode, paged_decode, plan_forest  # noqa: E402
from polynya.kernels.fca.plan import classes_triton  # noqa: E402
from polynya.kernels.fca.testing import build_forest, plan_difference, random_kv  # noqa: E402

CONFIGS = {  # name -> (plan kwargs, kernel config)
    "default": ({}, DecodeConfig()),
    "chunk1024": ({"chunk_tokens": 1024}, DecodeConfig()),
    "chunk512": ({"chunk_tokens": 512}, DecodeConfig()),
    "sh2/sm": ({}, DecodeConfig(shared_progs_per_sm=2)),
    "chunk1024 sh2/sm": ({"chunk_tokens": 1024}, DecodeConfig(shared_progs_per_sm=2)),
    "chunk512 sh2/sm": ({"chunk_tokens": 512}, DecodeConfig(shared_progs_per_sm=2)),
    "sh8warps": ({}, DecodeConfig(shared_num_warps=8)),
    "chunk1024 sh8warps": ({"chunk_tokens": 1024}, DecodeConfig(shared_num_warps=8)),
    "m32": ({}, DecodeConfig(block_m_shared=32)),
    "m32 chunk1024 sh2/sm": ({"chunk_tokens": 1024}, DecodeConfig(block_m_shared=32,
                                                                 shared_progs_per_sm=2)),
    "split": ({}, DecodeConfig(mode="split")),
    "split chunk1024": ({"chunk_tokens": 1024}, DecodeConfig(mode="split")),
}


def plan_times(bt: torch.Tensor, sl: torch.Tensor, page: int, width: int) -> dict:
    """Graph-replay ms of ``plan_forest`` on ``bt`` zero-padded to ``width`` columns, per
    backend, and of the Triton plan on ``bt`` as it is (``plan_triton_own_ms``: the forest's
    own width; what the padding costs is the difference); refuses to time plans that differ."""
    own_width = bt.shape[1]
    own = round(graph_ms(lambda: plan_forest(bt, sl, page, validate=False, backend="triton")), 4)
    if width > bt.shape[1]:
        bt = torch.cat([bt, bt.new_zeros(bt.shape[0], width - bt.shape[1])], 1)
    plans = {b: plan_forest(bt, sl, page, backend=b) for b in ("torch", "triton")}
    diff = plan_difference(plans["torch"], plans["triton"])
    if diff is not None:
        raise SystemExit(f"plan_forest(backend='triton') differs from the torch planner in {diff}")
    out = {"table_width": bt.shape[1], "own_width": own_width, "plan_triton_own_ms": own}
    for b in plans:
        out[f"plan_{b}_ms"] = round(graph_ms(
            lambda b=b: plan_forest(bt, sl, page, validate=False, backend=b)), 4)
    out["plan_classes_ms"] = round(graph_ms(lambda: classes_triton(bt, sl, page)), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--G", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--suffixes", default="16,64,128,256,384,512")
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--configs", default="all", help="comma-separated names or 'all'")
    ap.add_argument("--table-width", type=int, default=2560,
                    help="block-table columns the plan is timed on (0: the forest's own width)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a results JSON")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.replot[:-len(".json")] + ".png")
        return
    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    rows = []
    for s in [int(x) for x in args.suffixes.split(",")]:
        bt, sl, nb = build_forest([(args.groups, args.prompt_len), (args.G, s)], args.page,
                                  seed=s, device="cuda")
        k, v = random_kv(nb, args.page, args.hkv, args.d, torch.bfloat16, "cuda")
        q = torch.randn(bt.shape[0], args.hq, args.d, device="cuda", dtype=torch.bfloat16)
        ub = unique_bytes(bt, sl, args.page, args.hq, args.hkv, args.d, 2)
        ref = paged_decode(q, k, v, bt, sl)
        row = {"S": s, "unique_MB": round(ub / 1e6, 1),
               "paged_ms": round(graph_ms(lambda: paged_decode(q, k, v, bt, sl, validate=False)), 4)}
        for name in names:
            pkw, cfg = CONFIGS[name]
            plan = plan_forest(bt, sl, args.page, **pkw)
            out = fca_decode(q, k, v, plan, config=cfg)
            err = (out.float() - ref.float()).abs().max().item()
            if err > 0.05:
                raise SystemExit(f"S={s} {name}: FCA differs from paged by {err}")
            row[name] = round(graph_ms(lambda p=plan, c=cfg: fca_decode(q, k, v, p, config=c)), 4)
        row.update(plan_times(bt, sl, args.page, args.table_width))
        row["best"] = min(names, key=row.get)
        row["default_hbm_pct"] = round(100 * ub / (row["default"] * 1e-3) / H200_HBM_BYTES_PER_S, 1)
        row["best_hbm_pct"] = round(100 * ub / (row[row["best"]] * 1e-3) / H200_HBM_BYTES_PER_S, 1)
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()
    mean = {name: round(sum(r[name] for r in rows) / len(rows), 4) for name in ["paged_ms", *names]}
    print("mean over S:", mean)
    print("| S | paged | " + " | ".join(names) + " | plan torch | plan triton | of it: class pass "
          "| plan triton, own width |")
    for r in rows:
        print(f"| {r['S']} | {r['paged_ms']} | " + " | ".join(str(r[n]) for n in names)
              + f" | {r['plan_torch_ms']} | {r['plan_triton_ms']} | {r['plan_classes_ms']} "
              f"| {r['plan_triton_own_ms']} ({r['own_width']} cols) |")
    result = {"env": environment(), "args": vars(args), "rows": rows, "mean_over_S": mean}
    save(result, args.out, "probe_fca_suffix")
    plot(result, os.path.join(args.out, "probe_fca_suffix.png"))


def plot(result: dict, path: str) -> None:
    """Left: ms per decode call against S (the paged kernel, the default FCA config and the
    others). Right, when the run timed them: the forest plan's ms per step per backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, a = result["rows"], result["args"]
    names = [k for k in result["mean_over_S"] if k != "paged_ms"]
    xs = [r["S"] for r in rows]
    plans = [k for k in ("plan_auto_ms", "plan_torch_ms", "plan_triton_ms", "plan_classes_ms")
             if k in rows[0]]
    fig, axes = plt.subplots(1, 2 if plans else 1, figsize=(13 if plans else 9, 5), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]} if plans else None)
    ax = axes[0][0]
    ax.plot(xs, [r["paged_ms"] for r in rows], "k--", marker="s", label="paged (no sharing)")
    for name in names:
        style = {"lw": 2.5, "color": "C0"} if name == "default" else {"lw": 1, "alpha": 0.8}
        ax.plot(xs, [r[name] for r in rows], marker="o", ms=3, label=f"FCA {name}", **style)
    ax.set_xlabel("private suffix tokens per row S (decode step of a generation)")
    ax.set_ylabel("ms per decode call (one layer, CUDA-graph replay, median)")
    ax.set_yscale("log")
    ax.set_title(f"FCA decode vs suffix length: {a['groups']} prompts x G{a['G']}, P{a['prompt_len']}, "
                 f"Hq{a['hq']}/Hkv{a['hkv']}/D{a['d']}, page {a['page']}, bf16, H200", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    if plans:
        labels = {"plan_auto_ms": "plan, backend auto", "plan_torch_ms": "plan, torch ops",
                  "plan_triton_ms": "plan, Triton (4 launches)",
                  "plan_classes_ms": "of it: Triton class pass"}
        bx = axes[0][1]
        for k in plans:
            bx.plot(xs, [r[k] for r in rows], marker="o", label=labels[k])
        bx.set_yscale("log")
        bx.set_xlabel("private suffix tokens per row S")
        bx.set_ylabel("ms per decode step (once per step, CUDA-graph replay)")
        bx.set_title(f"forest plan, {a['groups'] * a['G']} rows x {rows[0]['table_width']} "
                     "table columns", fontsize=9)
        bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

if __name__ == "__main__":
    main()

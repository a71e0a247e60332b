"""ZoRRo Train vs naive: forward+backward step time and peak memory on one GPU.

Random-init Qwen3-0.6B-shaped model, bf16, gradient checkpointing on. For each P/R/G shape one
batch of ``--groups`` prompts x G responses goes through ``compute_logprobs`` + backward in the
same process, once per arm:

- ``naive`` — the baseline every speedup is measured against: ``zorro=False`` in the packed
  layout (all samples back to back without padding, each its own causal segment, prompts
  repeated per sample — what verl's remove-padding runs) with ``auto`` attention: one
  FlashAttention-2 varlen call per layer, or one cuDNN call over the padded batch of samples
  when their lengths are near-equal (``polynya.zorro.mask._leaf_batch_pays``);
- ``padded`` — ``zorro=False, naive_layout="padded"``: one right-padded row per sample under
  SDPA (the previous baseline), reported as an extra column;
- ``naive-varlen`` / ``naive-split`` / ``naive-flex`` (optional) — the packed naive layout
  forced through FlashAttention-2 varlen / cuDNN over the padded samples / FlexAttention's
  document mask (to check ``auto``'s pick);
- ``auto`` / ``split`` / ``flex`` — ZoRRo (``split``: cuDNN call per prompt + varlen responses +
  LSE merge; ``flex``: FlexAttention block mask); the first one listed is the headline.

Reports median step time, speedup of each path over ``naive``, peak memory (total and above
the weights+grads baseline) and the ideal token ratio G(P+R)/(P+GR). ``--ragged F`` draws
response lengths uniformly from [F*R, R] (RL-like; the padded arm then pays for padding).
``--fresh N`` instead runs N steps per arm with new lengths every step (what RL brings: new
shapes, plans and compiles) and reports every step's time, not only the median.

    python benchmarks/bench_zorro.py --groups 4 --out benchmarks/results
    python benchmarks/bench_zorro.py --groups 4 --shapes 256/512/8 --fresh 20   # + per-step PNG
    python benchmarks/bench_zorro.py --replot-fresh benchmarks/results/bench_zorro_g4_fresh.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (H200_BF16_FLOPS, cuda_median_ms, environment, markdown_table, median,  # noqa: E402
                    paired_bars,
                    save)

import polynya  # noqa: E402
from polynya.models import load_model  # noqa: E402

SHAPES = [(4096, 512, 8), (2048, 512, 8), (1024, 1024, 8), (256, 512, 8), (4096, 512, 16)]


NAIVE_ARMS = {"naive": dict(naive_layout="packed"), "padded": dict(naive_layout="padded"),
              "naive-varlen": dict(naive_layout="packed", zorro_attention="varlen"),
              "naive-flex": dict(naive_layout="packed", zorro_attention="flex"),
              "naive-split": dict(naive_layout="packed", zorro_attention="split")}
ZORRO_ARMS = ("auto", "split", "flex")


def make_batch(P: int, R: int, G: int, groups: int, vocab: int, seed: int,
               ragged: float = 1.0) -> polynya.RolloutBatch:
    """``groups`` prompts of P tokens x G responses of R tokens (``ragged < 1``: uniform lengths
    in [ragged * R, R])."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(P)]
        for _ in range(G):
            prompts.append(prompt)
            n = R if ragged >= 1 else rng.randint(max(1, int(ragged * R)), R)
            responses.append([rng.randrange(vocab) for _ in range(n)])
    adv = torch.randn(len(prompts))
    return polynya.RolloutBatch(prompts, responses, advantages=adv)


def step_fn(model, batch, arm: str):
    def run():
        if arm in NAIVE_ARMS:
            stats = polynya.compute_logprobs(model, batch, zorro=False, **NAIVE_ARMS[arm])
        else:
            stats = polynya.compute_logprobs(model, batch, zorro=True, zorro_attention=arm)
        loss = -(stats.logprobs * batch.advantages.to(stats.logprobs.device)[:, None]).sum() / stats.mask.sum()
        loss.backward()
    return run


def model_flops(cfg, P: int, R: int, G: int, groups: int, zorro: bool) -> float:
    """6·N·tokens for the matmuls (+ LM head on response tokens) + 12·pairs·H·D·layers attention."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * qd + 2 * h * kvd + qd * h + 3 * h * cfg.intermediate_size
    tokens = groups * ((P + G * R) if zorro else G * (P + R))
    pairs = groups * ((P * P / 2 + G * R * (P + R / 2)) if zorro else G * (P + R) ** 2 / 2)
    head = groups * G * R * h * cfg.vocab_size
    return 6 * per_layer * layers * tokens + 6 * head + 12 * pairs * qd * layers


def measure(model, batch, arm: str, iters: int):
    fn = step_fn(model, batch, arm)
    fn()  # compile / warm up; also allocates the grads so the baseline below includes them
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = cuda_median_ms(fn, warmup=1, iters=iters)
    peak = torch.cuda.max_memory_allocated()
    return median(times), peak, peak - base


def fresh_lengths(P: int, R: int, i: int) -> tuple[int, int]:
    """Step ``i``'s prompt and response lengths in a ``--fresh`` run (``measure_fresh``)."""
    return P - (37 * i) % (P // 2 + 1), R - (29 * i) % (R // 2 + 1)


def measure_fresh(model, P: int, R: int, G: int, groups: int, arm: str, steps: int,
                  ragged: float = 1.0) -> list[float]:
    """Step times (ms, host wall incl. sync) when every step brings new lengths, as in RL: step
    ``i`` takes prompts of ``P - (37 i mod (P/2 + 1))`` and responses of ``R - (29 i mod (R/2 +
    1))`` tokens (distinct for well over 20 steps: first sight of each shape)."""
    import time

    times = []
    for i in range(steps + 1):
        p, r = fresh_lengths(P, R, i)
        batch = make_batch(p, r, G, groups, model.config.vocab_size, seed=i, ragged=ragged)
        fn = step_fn(model, batch, arm)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:  # step 0 warms up everything that does not depend on the shape
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(f"{p}/{r}/{g}" for p, r, g in SHAPES))
    ap.add_argument("--arms", default="naive,padded,split,flex",
                    help="'naive' (packed, auto attention) first, then any of padded, "
                         "naive-varlen, naive-split, naive-flex, and one or more ZoRRo paths: "
                         "auto, split, flex")
    ap.add_argument("--ragged", type=float, default=1.0,
                    help="response lengths uniform in [RAGGED*R, R] (1: all R)")
    ap.add_argument("--fresh", type=int, default=0,
                    help="instead: N steps per arm with new lengths every step (RL-like)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--replot-fresh", metavar="JSON", help="only draw a --fresh run's PNG")
    args = ap.parse_args()
    if args.replot_fresh:
        plot_fresh(args.replot_fresh)
        return

    arms = args.arms.split(",")
    zorro_arms = [a for a in arms if a in ZORRO_ARMS]
    if (arms[0] != "naive" or not zorro_arms or not set(arms) <= set(NAIVE_ARMS) | set(ZORRO_ARMS)
            or len(set(arms)) != len(arms)):
        raise SystemExit(f"--arms: 'naive' first, then any of {sorted(NAIVE_ARMS)[1:]} and one or "
                         f"more of {ZORRO_ARMS}, each once")
    model = load_model(args.model, dtype="bfloat16", device="cuda")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = []
    shapes = args.shapes.split(",")
    name = "bench_zorro" if args.groups == 1 else f"bench_zorro_g{args.groups}"
    if args.fresh:
        fresh_runs(model, args, shapes, arms, name)
        return
    for shape in shapes:
        P, R, G = map(int, shape.split("/"))
        batch = make_batch(P, R, G, args.groups, model.config.vocab_size, seed=P + R + G,
                           ragged=args.ragged)
        res = {}
        for arm in arms:
            model.zero_grad(set_to_none=True)
            res[arm] = measure(model, batch, arm, args.iters)
        (tn, pn, dn), (tz, pz, dz) = res["naive"], res[zorro_arms[0]]
        fz = model_flops(model.config, P, R, G, args.groups, True)
        fn_ = model_flops(model.config, P, R, G, args.groups, False)
        row = dict(shape=f"P{P}/R{R}/G{G}", path=zorro_arms[0], naive_ms=round(tn, 1), zorro_ms=round(tz, 1),
                   speedup=round(tn / tz, 2), ideal=round(G * (P + R) / (P + G * R), 2),
                   flop_ratio=round(fn_ / fz, 2),
                   naive_peak_gb=round(pn / 2**30, 2), zorro_peak_gb=round(pz / 2**30, 2),
                   mem_ratio=round(pz / pn, 3), step_mem_ratio=round(dz / dn, 3),
                   naive_mfu=round(fn_ / (tn / 1e3) / H200_BF16_FLOPS, 3),
                   zorro_mfu=round(fz / (tz / 1e3) / H200_BF16_FLOPS, 3))
        others = [a for a in arms[1:] if a != zorro_arms[0]]
        for arm in others:  # the other naive layouts and ZoRRo paths, same batch
            row[f"{arm}_ms"] = round(res[arm][0], 1)
            row[f"{arm}_speedup"] = round(tn / res[arm][0], 2)  # > 1: faster than naive
        if "padded" in res:
            row["zorro_vs_padded"] = round(res["padded"][0] / tz, 2)
        rows.append(row)
        print(row, flush=True)
        # saved after every shape: a run cut by a time limit keeps what it measured
        save(dict(environment(), model=args.model, groups=args.groups, dtype="bfloat16", arms=arms,
                  ragged=args.ragged, naive="packed (naive_layout='packed', auto attention)",
                  cudnn_avoid_recompile=os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"),
                  gradient_checkpointing=True, complete=len(rows) == len(shapes), rows=rows),
             args.out, name)
    plot(dict(environment(), model=args.model, groups=args.groups, arms=[arms[0], *zorro_arms], rows=rows),
         os.path.join(args.out, f"{name}.png"))
    others = [(f"{a}_{k}", f"{a} {t}") for a in arms[1:] if a != zorro_arms[0]
              for k, t in (("ms", "ms"), ("speedup", "speedup"))]
    others += [("zorro_vs_padded", "ZoRRo vs padded")] if "padded" in arms else []
    print(markdown_table(rows, [("shape", "P/R/G"), ("naive_ms", "naive packed ms"), ("zorro_ms", f"ZoRRo {zorro_arms[0]} ms"),
                                ("speedup", "speedup"), *others, ("ideal", "ideal"), ("flop_ratio", "FLOP ratio"),
                                ("naive_peak_gb", "naive peak GB"), ("zorro_peak_gb", "ZoRRo peak GB"),
                                ("mem_ratio", "peak ratio"), ("step_mem_ratio", "step-mem ratio"),
                                ("naive_mfu", "naive MFU"), ("zorro_mfu", "ZoRRo MFU")]))


def fresh_runs(model, args, shapes: list[str], arms: list[str], name: str) -> None:
    """``--fresh``: every arm, N steps with new lengths each; every step's time saved and printed."""
    runs = []
    for shape in shapes:
        P, R, G = map(int, shape.split("/"))
        for arm in arms:
            ts = measure_fresh(model, P, R, G, args.groups, arm, args.fresh, args.ragged)
            runs.append(dict(shape=f"P{P}/R{R}/G{G}", arm=arm, median_ms=round(median(ts), 1),
                             first_ms=round(ts[0], 1), max_ms=round(max(ts), 1),
                             steps_ms=[round(t, 1) for t in ts]))
            print(f"fresh lengths every step, P{P}/R{R}/G{G} x{args.groups}, {arm}: median "
                  f"{median(ts):.1f} ms, steps {[round(t) for t in ts]}", flush=True)
            save(dict(environment(), model=args.model, groups=args.groups, dtype="bfloat16",
                      ragged=args.ragged, steps=args.fresh, lengths="P - (37 i mod (P/2+1)), R - (29 i mod (R/2+1)) at step i",
                      gradient_checkpointing=True, runs=runs), args.out, f"{name}_fresh")
    print(markdown_table(runs, [("shape", "P/R/G"), ("arm", "arm"), ("median_ms", "median ms"),
                                ("first_ms", "first ms"), ("max_ms", "max ms")]))
    plot_fresh(os.path.join(args.out, f"{name}_fresh.json"))


def plot_fresh(json_path: str) -> None:
    """Every step's time per arm (one line each; log scale: first steps pay compiles), PNG
    beside the JSON; no-op without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    with open(json_path) as f:
        res = json.load(f)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for run in res["runs"]:
        steps = run["steps_ms"]
        ax.plot(range(1, len(steps) + 1), steps, marker="o", markersize=3,
                label=f"{run['shape']} {run['arm']} (median {run['median_ms']:.0f} ms)")
    ax.set_yscale("log")
    ax.set_xlabel("step (new prompt and response lengths every step)")
    ax.set_ylabel("forward + backward ms (log)")
    ax.set_title(f"ZoRRo Train vs naive, fresh lengths every step: {res.get('model', '')}, "
                 f"{res.get('groups', '?')} groups/step\n{res.get('gpu', '')} {res.get('date', '')}",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.splitext(json_path)[0] + ".png", dpi=120)
    plt.close(fig)


def plot(results: dict, path: str) -> None:
    """Measured vs ideal speedup per shape, titled with the GPU, model, groups and ZoRRo path."""
    rows = results["rows"]
    title = (f"ZoRRo Train vs naive (compute_logprobs + backward): {results.get('model', '')}, "
             f"{results.get('groups', '?')} prompt groups/step\nZoRRo path "
             f"{(results.get('arms') or ['', '?'])[1]} — {results.get('gpu', '')} {results.get('date', '')}")
    paired_bars(path, [r["shape"] for r in rows], [r["speedup"] for r in rows], "measured speedup",
                [r["ideal"] for r in rows], "ideal G(P+R)/(P+GR)", "naive / ZoRRo step time",
                title=title, ref_line=1.0)


if __name__ == "__main__":
    main()

"""ZoRRo Train vs naive: forward+backward step time and peak memory on one GPU.

Random-init Qwen3-0.6B-shaped model, bf16, gradient checkpointing on. For each P/R/G shape one
batch of ``--groups`` prompts x G responses goes through ``compute_logprobs`` + backward, with
``zorro=False`` (one row per sample, SDPA causal) and ``zorro=True`` with each ZoRRo attention
path (``split``: cuDNN call per prompt + varlen responses + LSE merge; ``flex``: FlexAttention
block mask) in the same process. Reports median step time, speedup of each path, peak memory
(total and above the weights+grads baseline) and the ideal token ratio G(P+R)/(P+GR).

    python benchmarks/bench_zorro.py --groups 4 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import gc
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


def make_batch(P: int, R: int, G: int, groups: int, vocab: int, seed: int) -> polynya.RolloutBatch:
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(P)]
        for _ in range(G):
            prompts.append(prompt)
            responses.append([rng.randrange(vocab) for _ in range(R)])
    adv = torch.randn(len(prompts))
    return polynya.RolloutBatch(prompts, responses, advantages=adv)


def step_fn(model, batch, arm: str):
    def run():
        if arm == "naive":
            stats = polynya.compute_logprobs(model, batch, zorro=False)
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


def measure_fresh(model, P: int, R: int, G: int, groups: int, arm: str, steps: int) -> list[float]:
    """Step times (ms, host wall incl. sync) when every step brings new lengths, as in RL: the
    prompt and response lengths shrink by a few tokens per step (first sight of each shape)."""
    import time

    times = []
    for i in range(steps + 1):
        batch = make_batch(P - 37 * i, R - 5 * i, G, groups, model.config.vocab_size, seed=i)
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
    ap.add_argument("--arms", default="naive,split,flex", help="naive first; ZoRRo paths after")
    ap.add_argument("--fresh", type=int, default=0,
                    help="instead: N steps per ZoRRo arm with new lengths every step (RL-like)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    model = load_model(args.model, dtype="bfloat16", device="cuda")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = []
    shapes = args.shapes.split(",")
    arms = args.arms.split(",")
    if arms[0] != "naive" or len(arms) < 2 or not set(arms[1:]) <= {"auto", "split", "flex"}:
        raise SystemExit("--arms: 'naive' first, then one or more of auto, split, flex")
    name = "bench_zorro" if args.groups == 1 else f"bench_zorro_g{args.groups}"
    if args.fresh:
        for shape in shapes:
            P, R, G = map(int, shape.split("/"))
            for arm in arms[1:]:
                ts = measure_fresh(model, P, R, G, args.groups, arm, args.fresh)
                print(f"fresh lengths every step, P{P}/R{R}/G{G} x{args.groups}, {arm}: median "
                      f"{median(ts):.1f} ms, steps {[round(t) for t in ts]}", flush=True)
        return
    for shape in shapes:
        P, R, G = map(int, shape.split("/"))
        batch = make_batch(P, R, G, args.groups, model.config.vocab_size, seed=P + R + G)
        res = {}
        for arm in arms:
            model.zero_grad(set_to_none=True)
            res[arm] = measure(model, batch, arm, args.iters)
        (tn, pn, dn), (tz, pz, dz) = res["naive"], res[arms[1]]
        fz = model_flops(model.config, P, R, G, args.groups, True)
        fn_ = model_flops(model.config, P, R, G, args.groups, False)
        row = dict(shape=f"P{P}/R{R}/G{G}", path=arms[1], naive_ms=round(tn, 1), zorro_ms=round(tz, 1),
                   speedup=round(tn / tz, 2), ideal=round(G * (P + R) / (P + G * R), 2),
                   flop_ratio=round(fn_ / fz, 2),
                   naive_peak_gb=round(pn / 2**30, 2), zorro_peak_gb=round(pz / 2**30, 2),
                   mem_ratio=round(pz / pn, 3), step_mem_ratio=round(dz / dn, 3),
                   naive_mfu=round(fn_ / (tn / 1e3) / H200_BF16_FLOPS, 3),
                   zorro_mfu=round(fz / (tz / 1e3) / H200_BF16_FLOPS, 3))
        for arm in arms[2:]:  # the other ZoRRo paths, same batch
            row[f"{arm}_ms"] = round(res[arm][0], 1)
            row[f"{arm}_speedup"] = round(tn / res[arm][0], 2)
        rows.append(row)
        print(row, flush=True)
        # saved after every shape: a run cut by a time limit keeps what it measured
        save(dict(environment(), model=args.model, groups=args.groups, dtype="bfloat16", arms=arms,
                  cudnn_avoid_recompile=os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"),
                  gradient_checkpointing=True, complete=len(rows) == len(shapes), rows=rows),
             args.out, name)
    plot(dict(environment(), model=args.model, groups=args.groups, arms=arms, rows=rows),
         os.path.join(args.out, f"{name}.png"))
    others = [(f"{a}_{k}", f"{a} {t}") for a in arms[2:] for k, t in (("ms", "ms"), ("speedup", "speedup"))]
    print(markdown_table(rows, [("shape", "P/R/G"), ("naive_ms", "naive ms"), ("zorro_ms", f"ZoRRo {arms[1]} ms"),
                                ("speedup", "speedup"), *others, ("ideal", "ideal"), ("flop_ratio", "FLOP ratio"),
                                ("naive_peak_gb", "naive peak GB"), ("zorro_peak_gb", "ZoRRo peak GB"),
                                ("mem_ratio", "peak ratio"), ("step_mem_ratio", "step-mem ratio"),
                                ("naive_mfu", "naive MFU"), ("zorro_mfu", "ZoRRo MFU")]))


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

"""ZoRRo Train vs naive: forward+backward step time and peak memory on one GPU.

Random-init Qwen3-0.6B-shaped model, bf16, gradient checkpointing on. For each P/R/G shape one
batch of ``--groups`` prompts x G responses goes through ``compute_logprobs`` + backward, with
``zorro=False`` (one row per sample, SDPA causal) and ``zorro=True`` (FlexAttention block mask)
in the same process. Reports median step time, speedup, peak memory (total and above the
weights+grads baseline) and the ideal token ratio G(P+R)/(P+GR).

    python benchmarks/bench_zorro.py --out benchmarks/results
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


def step_fn(model, batch, zorro: bool):
    def run():
        stats = polynya.compute_logprobs(model, batch, zorro=zorro)
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


def measure(model, batch, zorro: bool, iters: int):
    fn = step_fn(model, batch, zorro)
    fn()  # compile / warm up; also allocates the grads so the baseline below includes them
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = cuda_median_ms(fn, warmup=1, iters=iters)
    peak = torch.cuda.max_memory_allocated()
    return median(times), peak, peak - base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(f"{p}/{r}/{g}" for p, r, g in SHAPES))
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    model = load_model(args.model, dtype="bfloat16", device="cuda")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = []
    shapes = args.shapes.split(",")
    name = "bench_zorro" if args.groups == 1 else f"bench_zorro_g{args.groups}"
    for shape in shapes:
        P, R, G = map(int, shape.split("/"))
        batch = make_batch(P, R, G, args.groups, model.config.vocab_size, seed=P + R + G)
        res = {}
        for zorro in (False, True):
            model.zero_grad(set_to_none=True)
            res[zorro] = measure(model, batch, zorro, args.iters)
        (tn, pn, dn), (tz, pz, dz) = res[False], res[True]
        fz = model_flops(model.config, P, R, G, args.groups, True)
        fn_ = model_flops(model.config, P, R, G, args.groups, False)
        row = dict(shape=f"P{P}/R{R}/G{G}", naive_ms=round(tn, 1), zorro_ms=round(tz, 1),
                   speedup=round(tn / tz, 2), ideal=round(G * (P + R) / (P + G * R), 2),
                   flop_ratio=round(fn_ / fz, 2),
                   naive_peak_gb=round(pn / 2**30, 2), zorro_peak_gb=round(pz / 2**30, 2),
                   mem_ratio=round(pz / pn, 3), step_mem_ratio=round(dz / dn, 3),
                   naive_mfu=round(fn_ / (tn / 1e3) / H200_BF16_FLOPS, 3),
                   zorro_mfu=round(fz / (tz / 1e3) / H200_BF16_FLOPS, 3))
        rows.append(row)
        print(row, flush=True)
        # saved after every shape: a run cut by a time limit keeps what it measured
        save(dict(environment(), model=args.model, groups=args.groups, dtype="bfloat16",
                  gradient_checkpointing=True, complete=len(rows) == len(shapes), rows=rows),
             args.out, name)
    paired_bars(os.path.join(args.out, f"{name}.png"), [r["shape"] for r in rows],
                [r["speedup"] for r in rows], "measured speedup", [r["ideal"] for r in rows],
                "ideal G(P+R)/(P+GR)", "naive / ZoRRo step time")
    print(markdown_table(rows, [("shape", "P/R/G"), ("naive_ms", "naive ms"), ("zorro_ms", "ZoRRo ms"),
                                ("speedup", "speedup"), ("ideal", "ideal"), ("flop_ratio", "FLOP ratio"),
                                ("naive_peak_gb", "naive peak GB"), ("zorro_peak_gb", "ZoRRo peak GB"),
                                ("mem_ratio", "peak ratio"), ("step_mem_ratio", "step-mem ratio"),
                                ("naive_mfu", "naive MFU"), ("zorro_mfu", "ZoRRo MFU")]))


if __name__ == "__main__":
    main()

"""The native sampler's prefill with compiled layers (``SamplerConfig.compile_prefill``) against
the eager prefill, side by side in one process.

Two engines of the same model and weights (same spec and seed), one with ``compile_prefill=True``
and one with ``False`` (everything else at the sampler's defaults), prefill the same fresh
prompts: each call is ``generate(prompts, max_tokens=1)`` — one prefill of every prompt (in
steps of at most ``max_num_batched_tokens``) and the first token, no decode step. Every call
brings new random prompts whose lengths vary around ``--prompt-len`` (``--jitter``), as an RL
step's do, so no prefix-cache hit and no shape repeats; the engines' first calls (which pay the
compile) are reported apart. Calls alternate ABBA over ``--repeat`` rounds; reported per shape:
median wall ms per call (device synchronised), the engines' own prefill time, tokens/s, the
model FLOPs per call (``2 x non-embedding params x tokens`` + causal attention) as a fraction of
the H200's ~790 TFLOP/s, the compile count and seconds, and the first tokens' agreement between
the arms (greedy; bf16 near-ties may differ) with the largest log-prob difference where they
agree::

    python benchmarks/bench_prefill.py --out $OUT                       # H200, ~2 min
    python benchmarks/bench_prefill.py --model tiny:qwen3 --dtype float32 --shapes 2x40 \\
        --repeat 1 --out /tmp/bp                                         # CPU smoke, no numbers
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import torch
from common import H200_BF16_FLOPS, environment, markdown_table, median, paired_bars, save
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine

ARMS = (("eager", False), ("compiled", True))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts_for(n: int, length: int, jitter: int, vocab: int, seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    lens = g.integers(max(1, length - jitter), length + jitter + 1, size=n)
    return [g.integers(100, vocab - 100, size=int(m)).tolist() for m in lens]


def model_flops(engine: SamplingEngine, prompts: list[list[int]]) -> float:
    """Forward FLOPs of a prefill: 2 x non-embedding parameters per token + causal attention
    (QK^T and PV: 2 x 2 x L^2 / 2 x heads x head dim per layer)."""
    model = engine.backend.runner.model
    embed = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embed
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = sum(2 * len(p) ** 2 * cfg.num_attention_heads * head_dim for p in prompts)
    return 2.0 * params * sum(map(len, prompts)) + attn * cfg.num_hidden_layers


def call(engine: SamplingEngine, prompts: list[list[int]]) -> tuple[float, float, list]:
    """(wall ms, engine prefill ms, first samples) of one prefill-only generate."""
    before = engine.stats()["prefill_time_s"]
    _sync()
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=True,
                                                  stop_token_ids=()))
    _sync()
    wall = (time.perf_counter() - t0) * 1e3
    return wall, (engine.stats()["prefill_time_s"] - before) * 1e3, [o[0] for o in out]


def run_shape(engines: dict, n: int, length: int, args, seed0: int) -> dict:
    vocab = engines["eager"].backend.runner.vocab_size
    first = {}
    for i, (name, _) in enumerate(ARMS):  # first calls: the compiled arm compiles here
        wall, _, _ = call(engines[name], prompts_for(n, length, args.jitter, vocab, seed0 + i))
        first[name] = wall
    walls = {name: [] for name, _ in ARMS}
    prefill = {name: [] for name, _ in ARMS}
    agree, total, max_diff = 0, 0, 0.0
    order = [name for name, _ in ARMS]
    for r in range(args.repeat):
        prompts = prompts_for(n, length, args.jitter, vocab, seed0 + 100 + r)
        samples = {}
        for name in (order if r % 2 == 0 else order[::-1]):
            wall, pre, samples[name] = call(engines[name], prompts)
            walls[name].append(wall)
            prefill[name].append(pre)
        for a, b in zip(samples["eager"], samples["compiled"]):
            total += 1
            if a.token_ids == b.token_ids:
                agree += 1
                max_diff = max(max_diff, abs(a.logprobs[0] - b.logprobs[0]))
    flops = model_flops(engines["eager"], prompts_for(n, length, 0, vocab, 0))
    row = {"shape": f"{n}x{length}", "tokens": n * length, "tflop": flops / 1e12,
           "first_calls_ms": first, "runs_wall_ms": walls, "runs_prefill_ms": prefill,
           "first_token_agreement": f"{agree}/{total}", "max_logprob_diff_agreeing": max_diff}
    for name, _ in ARMS:
        ms = median(walls[name])
        row[f"{name}_ms"] = ms
        row[f"{name}_prefill_ms"] = median(prefill[name])
        row[f"{name}_tok_s"] = n * length / ms * 1e3
        row[f"{name}_mfu"] = flops / (ms / 1e3) / H200_BF16_FLOPS
    row["speedup"] = row["eager_ms"] / row["compiled_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    ap.add_argument("--model", default="random:qwen3-0.6b" if cuda else "tiny:qwen3")
    ap.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    ap.add_argument("--shapes", default="8x6500,8x256,64x256",
                    help="prompts x prompt length, comma-separated")
    ap.add_argument("--jitter", type=int, default=64, help="prompt lengths vary by +- this much")
    ap.add_argument("--repeat", type=int, default=6, help="timed calls per arm and shape")
    ap.add_argument("--kv-gb", type=float, default=16.0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    engines, build = {}, {}
    for name, on in ARMS:
        t0 = time.perf_counter()
        engines[name] = SamplingEngine(SamplerConfig(args.model, dtype=args.dtype, seed=0,
                                                     kv_cache_memory_gb=args.kv_gb,
                                                     compile_prefill=on))
        build[name] = time.perf_counter() - t0
    rows = []
    for i, shape in enumerate(args.shapes.split(",")):
        n, length = (int(x) for x in shape.split("x"))
        rows.append(run_shape(engines, n, length, args, seed0=1000 * (i + 1)))
        print(f"{shape}: eager {rows[-1]['eager_ms']:.1f} ms, compiled {rows[-1]['compiled_ms']:.1f} ms, "
              f"{rows[-1]['speedup']:.2f}x", flush=True)
    stats = {name: {k: v for k, v in e.stats().items() if "compile" in k} for name, e in engines.items()}
    for r in rows:
        r["eager_mfu_pct"] = f"{100 * r['eager_mfu']:.1f}"
        r["compiled_mfu_pct"] = f"{100 * r['compiled_mfu']:.1f}"
        for key in ("eager_ms", "compiled_ms", "eager_prefill_ms", "compiled_prefill_ms", "tflop"):
            r[key + "_fmt"] = f"{r[key]:.2f}"
        r["speedup_fmt"] = f"{r['speedup']:.2f}x"
        r["first_fmt"] = f"{r['first_calls_ms']['eager']:.0f} / {r['first_calls_ms']['compiled']:.0f}"
    print(markdown_table(rows, [
        ("shape", "prompts x P"), ("tflop_fmt", "TFLOP / call"), ("eager_ms_fmt", "eager ms"),
        ("compiled_ms_fmt", "compiled ms"), ("speedup_fmt", "speedup"),
        ("eager_prefill_ms_fmt", "eager prefill ms"), ("compiled_prefill_ms_fmt", "compiled prefill ms"),
        ("eager_mfu_pct", "MFU eager %"), ("compiled_mfu_pct", "MFU compiled %"),
        ("first_fmt", "first call ms (eager / compiled)"),
        ("first_token_agreement", "first tokens equal")]))
    print(stats)
    results = {"env": environment(), "args": vars(args), "engine_build_s": build,
               "compile_stats": stats, "rows": rows}
    print("saved", save(results, args.out, "bench_prefill"))
    paired_bars(os.path.join(args.out, "bench_prefill.png"), [r["shape"] for r in rows],
                [r["eager_ms"] for r in rows], "eager prefill", [r["compiled_ms"] for r in rows],
                "compiled prefill (compile_prefill)", "ms per prefill call (median)",
                title=f"Native sampler prefill, {args.model} {args.dtype}: eager vs compiled layers "
                      f"({environment()['gpu']})", log=True)


if __name__ == "__main__":
    main()

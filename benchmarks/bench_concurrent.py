"""Concurrent generate calls against one batched call, on one native-sampler engine, side by side.

An HTTP server's clients (vLLM-style routes, SkyRL's remote client) and verl's agent loop send
each prompt — often each sample — as a request of its own; a serving engine has to batch them as
if they had come in one call. Arms, on the same engine (one copy of the weights), each run on
fresh prompts of the same shape (the prefix cache cannot carry over between runs):

- ``batched``: one ``generate`` call with every prompt, ``n = G`` samples each — the best a
  single caller can do, and the baseline;
- ``per_prompt``: one ``generate_async`` call per prompt (``n = G``), all at once;
- ``per_sample``: one ``generate_async`` call per sample (``n = 1``, a group's G calls share a
  prompt), all at once — verl's agent loop.

Calls go through ``SamplingEngine.generate_async`` (what verl's rollout server and, through
``LocalClient``, the HTTP server call), ``asyncio.gather`` sends them together. Per arm: wall
time, decode steps, the most rows one decode step carried, prompt tokens computed (prefill; a
group's shared prompt is computed once when its samples share pages), and decode tokens per
second; the ratio of each arm's wall time to ``batched``'s.

    python benchmarks/bench_concurrent.py --groups 8 --G 8 --prompt-len 256 --new-tokens 128
    -> results/bench_concurrent.json
    python benchmarks/bench_concurrent.py --replot results/X.json --before results/Y.json
    -> results/X.png: each arm's wall time over the batched call's, X's code against Y's
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import torch
from common import (
    add_sampler_shape_args,
    environment,
    make_prompts,
    markdown_table,
    paired_bars,
    save,
)
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine

COUNTERS = ("decode_steps", "decode_tokens", "prefill_tokens", "cache_hit_tokens", "prefill_steps",
            "fca_steps", "prefill_time_s", "decode_time_s")


def calls(arm: str, prompts: list[list[int]], args) -> list[tuple[list[list[int]], SamplingParams]]:
    """The (prompts, params) of each call an arm makes; seeds make every arm sample the same
    way per (prompt, sample) where the engine allows it."""
    def p(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, max_tokens=args.new_tokens, stop_token_ids=(),
                              seed=seed)

    if arm == "batched":
        return [(prompts, p(args.G, 0))]
    if arm == "per_prompt":
        return [([x], p(args.G, i)) for i, x in enumerate(prompts)]
    return [([x], p(1, i * args.G + j)) for i, x in enumerate(prompts) for j in range(args.G)]


def run_arm(engine: SamplingEngine, arm: str, prompts, args) -> dict:
    todo = calls(arm, prompts, args)
    before = engine.stats()
    peak0 = before["peak_decode_rows"]
    engine.backend._counts["peak_decode_rows"] = 0  # this run's peak (restored below)
    t0 = time.perf_counter()
    if arm == "batched":
        outs = [engine.generate(*todo[0])]
    else:
        async def go():
            return await asyncio.gather(*(engine.generate_async(ps, q) for ps, q in todo))
        outs = asyncio.run(go())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    after = engine.stats()
    engine.backend._counts["peak_decode_rows"] = max(peak0, after["peak_decode_rows"])
    d = {k: after[k] - before[k] for k in COUNTERS}
    d["peak_rows"] = after["peak_decode_rows"]
    d["wall_s"] = wall
    d["samples"] = sum(len(g) for o in outs for g in o)
    d["decode_tok_per_s"] = d["decode_tokens"] / wall
    return d


def plot(after_path: str, before_path: str, labels: tuple[str, str] = ("this code", "before")) -> str:
    """Each arm's wall time over its run's batched call, two runs side by side (PNG)."""
    with open(after_path) as f:
        after = json.load(f)
    with open(before_path) as f:
        before = json.load(f)
    arms = [a for a in after["arms"] if a in before["arms"]]
    c = after["config"]
    out = os.path.splitext(after_path)[0] + ".png"
    paired_bars(out, arms, [after["arms"][a]["vs_batched"] for a in arms], labels[0],
                [before["arms"][a]["vs_batched"] for a in arms], labels[1],
                "wall time / one batched call (x)",
                title=f"Concurrent generate calls vs one batched call\n({c['model']}, {after['gpu'] or 'cpu'}, "
                      f"{c['groups']} prompts x G{c['G']}, P{c['prompt_len']}, {c['new_tokens']} new tokens)",
                ref_line=1.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    add_sampler_shape_args(ap)
    ap.add_argument("--arms", default="batched,per_prompt,per_sample")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--replot", metavar="JSON", help="only draw JSON's PNG against --before")
    ap.add_argument("--before", metavar="JSON", help="a run of other code to draw against")
    ap.add_argument("--labels", default="this code,before", help="the two runs' names in the PNG")
    args = ap.parse_args()
    labels = tuple(args.labels.split(","))
    if len(labels) != 2 or not all(labels):
        ap.error(f"--labels needs two names separated by one comma, got {args.labels!r}")
    if args.replot:
        if not args.before:
            ap.error("--replot draws a run against another: give --before JSON too")
        print("wrote", plot(args.replot, args.before, labels))
        return
    rows = args.groups * args.G
    cfg = SamplerConfig(args.model, dtype=args.dtype, block_size=args.block_size,
                        max_num_seqs=max(rows, 8), kv_cache_memory_gb=4.0 if cuda else 0.5,
                        max_model_len=args.prompt_len + args.new_tokens + args.block_size)
    engine = SamplingEngine(cfg)
    vocab = engine.backend.runner.vocab_size
    arms = args.arms.split(",")
    seed = 1000
    for arm in arms:  # warm-up: graphs captured, kernels compiled, threads started
        run_arm(engine, arm, make_prompts(args.groups, args.prompt_len, vocab, seed), args)
        seed += 1
    results = {"config": vars(args), **environment(), "arms": {}}
    for arm in arms:
        runs = []
        for _ in range(args.repeats):
            runs.append(run_arm(engine, arm, make_prompts(args.groups, args.prompt_len, vocab, seed), args))
            seed += 1
        best = dict(runs[0])
        best["wall_s"] = statistics.median(r["wall_s"] for r in runs)
        best["decode_tok_per_s"] = statistics.median(r["decode_tok_per_s"] for r in runs)
        best["runs_wall_s"] = [r["wall_s"] for r in runs]
        results["arms"][arm] = best
        print(f"{arm:>10}: {best['wall_s']:.3f} s  decode steps {best['decode_steps']}  peak rows "
              f"{best['peak_rows']}  prefill tokens {best['prefill_tokens']}  "
              f"{best['decode_tok_per_s']:.0f} decode tok/s  (prefill steps {best['prefill_steps']}, "
              f"{best['prefill_time_s']:.3f} s; decode {best['decode_time_s']:.3f} s, FCA steps "
              f"{best['fca_steps']})", flush=True)
    base = results["arms"].get("batched")
    table = []
    for arm, d in results["arms"].items():
        d["vs_batched"] = d["wall_s"] / base["wall_s"] if base else None
        table.append({"arm": arm, "wall": f"{d['wall_s']:.3f}", "steps": d["decode_steps"],
                      "peak": d["peak_rows"], "prefill": d["prefill_tokens"],
                      "tps": f"{d['decode_tok_per_s']:.0f}",
                      "ratio": "" if d["vs_batched"] is None else f"{d['vs_batched']:.2f}x"})
    print(markdown_table(table, [("arm", "arm"), ("wall", "wall s (median)"), ("steps", "decode steps"),
                                 ("peak", "peak rows"), ("prefill", "prompt tokens computed"),
                                 ("tps", "decode tok/s"), ("ratio", "wall / batched")]))
    path = save(results, args.out, "bench_concurrent")
    print("wrote", path)
    if args.before:
        print("wrote", plot(path, args.before, labels))
    engine.shutdown()


if __name__ == "__main__":
    main()

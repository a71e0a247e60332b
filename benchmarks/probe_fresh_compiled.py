"""Does a compiled ZoRRo training step pay for new lengths (issue 15 goal 4)?

The long-context QA recipe's ZoRRo forward/backward takes 1.47-1.75 s for 4 micro-batches of 2
groups (P~6.4k, R<=128, G8) while ``profile_zorro_step.py --scan`` times the same micro-batch,
repeated, at ~0.32 s. This probe times one micro-batch shape repeated, then ``--fresh`` steps
with new lengths every step (``bench_zorro.measure_fresh``), eager and compiled, one process::

    cd benchmarks; python probe_fresh_compiled.py --shape 6400/128/8 --groups 2 --fresh 6
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_zorro import make_batch, measure_fresh, step_fn
from common import environment, save
from polynya.compiled_layers import compile_layers, uncompile_layers
from polynya.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--shape", default="6400/128/8")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--arm", default="split")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fresh", type=int, default=6)
    ap.add_argument("--modes", default="compiled,eager")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    P, R, G = map(int, args.shape.split("/"))
    model = load_model(args.model, dtype="bfloat16", device="cuda")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = []
    for mode in args.modes.split(","):
        uncompile_layers(model)
        if mode == "compiled":
            compile_layers(model)
        fn = step_fn(model, make_batch(P, R, G, args.groups, model.config.vocab_size, seed=99), args.arm)
        same = []
        for i in range(args.repeat + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            same.append((time.perf_counter() - t0) * 1e3)
        fresh = measure_fresh(model, P, R, G, args.groups, args.arm, args.fresh, ragged=0.5)
        row = {"mode": mode, "same_ms": [round(x, 1) for x in same], "fresh_ms": [round(x, 1) for x in fresh],
                   "same_median": round(statistics.median(same[2:]), 1),
                   "fresh_median": round(statistics.median(fresh), 1)}
        rows.append(row)
        print(row, flush=True)
    save(dict(environment(), shape=args.shape, groups=args.groups, arm=args.arm, rows=rows),
         args.out, "probe_fresh_compiled")


if __name__ == "__main__":
    main()

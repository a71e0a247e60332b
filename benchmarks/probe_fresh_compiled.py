"""Does a compiled ZoRRo training step pay for new lengths (issue 15 goal 4)?

The long-context QA recipe's ZoRRo forward/backward takes 1.47-1.75 s for 4 micro-batches of 2
groups (P~6.4k, R<=128, G8) while ``profile_zorro_step.py --scan`` times the same micro-batch,
repeated, at ~0.32 s. This probe times one micro-batch shape repeated, then ``--fresh`` steps
with new lengths every step (``bench_zorro.measure_fresh``), eager and compiled, one process::

    cd benchmarks; python probe_fresh_compiled.py --shape 6400/128/8 --groups 2 --fresh 6

``--micro-batch-tokens`` sets the engine's budget (16384, the default, holds 2 such groups);
``--profile`` runs one more engine step under ``torch.profiler`` and reports wall vs GPU-busy
time of ``forward_backward`` and ``step`` with the top host calls::

    python probe_fresh_compiled.py --groups 8 --modes compiled,engine --micro-batch-tokens 65536 --profile
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_zorro import fresh_lengths, make_batch, measure_fresh, step_fn
from common import environment, profile_call, save
from polynya.compiled_layers import compile_layers, uncompile_layers
from polynya.models import load_model


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def engine_row(args, P: int, R: int, G: int) -> dict:
    """The training engine with the recipe's settings: same batch repeated, then new lengths."""
    from polynya.config import TrainConfig
    from polynya.engines import TrainingEngine

    cfg = TrainConfig(args.model, dtype="bfloat16" if args.device == "cuda" else "float32", zero_stage=2, lr=1e-6, gradient_checkpointing=True,
                      compile_layers=True, micro_batch_tokens=args.micro_batch_tokens, log_entropy=True)
    engine = TrainingEngine(cfg)
    vocab = engine.module.config.vocab_size
    plans = []

    def step(batch):
        def fn():
            plans.append(engine.forward_backward(batch)["micro_batches"])
            engine.step()
        return fn

    same_batch = make_batch(P, R, G, args.engine_groups, vocab, seed=99)
    same = [timed(step(same_batch)) for _ in range(args.repeat + 2)]
    fresh = [timed(step(make_batch(*fresh_lengths(P, R, i), G, args.engine_groups, vocab, seed=i,
                                   ragged=0.5)))
             for i in range(1, args.fresh + 1)]
    extra = profile_engine(engine, make_batch(*fresh_lengths(P, R, 99), G, args.engine_groups, vocab,
                                              seed=99, ragged=0.5)) if args.profile else {}
    return result("engine", same, fresh, groups=args.engine_groups, micro_batches=plans,
                  micro_batch_tokens=args.micro_batch_tokens, **extra)


def profile_engine(engine, batch) -> dict:
    """One engine step under ``torch.profiler`` (``common.profile_call``): ``forward_backward``
    and ``step`` apart."""
    return {"profile": {"forward_backward": profile_call(lambda: engine.forward_backward(batch))[1],
                        "step": profile_call(engine.step)[1]}}


def result(mode: str, same: list[float], fresh: list[float], **extra) -> dict:
    """A mode's row: every time (ms) and the medians (the repeated batch's first two, which
    compile and warm up, left out)."""
    return {"mode": mode, **extra, "same_ms": [round(x, 1) for x in same],
            "fresh_ms": [round(x, 1) for x in fresh], "same_median": round(statistics.median(same[2:]), 1),
            "fresh_median": round(statistics.median(fresh), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--shape", default="6400/128/8")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--arm", default="split")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fresh", type=int, default=6)
    ap.add_argument("--modes", default="compiled,eager,engine")
    ap.add_argument("--engine-groups", type=int, default=8)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="the engine's budget")
    ap.add_argument("--profile", action="store_true", help="one more engine step, profiled")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script only")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if set(modes) - {"compiled", "eager", "engine"}:
        ap.error(f"--modes takes compiled, eager and engine, got {args.modes!r}")
    P, R, G = map(int, args.shape.split("/"))
    if args.device == "cpu":  # nothing here is timed on the CPU; the calls only have to run
        torch.cuda.synchronize = lambda: None
    model = load_model(args.model, dtype="bfloat16" if args.device == "cuda" else "float32",
                       device=args.device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = []
    for mode in (m for m in modes if m != "engine"):
        uncompile_layers(model)
        if mode == "compiled":
            compile_layers(model)
        fn = step_fn(model, make_batch(P, R, G, args.groups, model.config.vocab_size, seed=99), args.arm)
        same = [timed(fn) for _ in range(args.repeat + 2)]
        fresh = measure_fresh(model, P, R, G, args.groups, args.arm, args.fresh, ragged=0.5)
        rows.append(result(mode, same, fresh))
        print(rows[-1], flush=True)
    if "engine" in modes:  # last: the engine loads its own copy of the model
        del model
        torch.cuda.empty_cache()
        rows.append(engine_row(args, P, R, G))
        print(rows[-1], flush=True)
    save(dict(environment(), shape=args.shape, groups=args.groups, arm=args.arm, rows=rows),
         args.out, "probe_fresh_compiled")


if __name__ == "__main__":
    main()

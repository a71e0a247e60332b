"""Where a small training step's time goes: ``compute_logprobs`` + backward, per layout, profiled.

At GSM8K-like shapes (one group of G=8 per micro-batch, ~128-256-token prompts and responses,
what TRL's and the recipes' micro-batches hold) the step is far from the GPU's limits
(``bench_zorro.py``: 1-4 % MFU), and ZoRRo and the packed naive layout ran slower than the
padded one. This script runs ``bench_zorro.py``'s step (same batch, gradient checkpointing on)
for each arm and reports, from ``torch.profiler`` over ``--iters`` steps after a warm-up:

- wall ms per step (CUDA-synchronised), GPU busy ms per step (union of kernel intervals) — the
  gap is host time the GPU waits for;
- kernels launched per step and the top kernels by GPU time;
- the top aten / runtime calls by self CPU time (``cudaMemcpyAsync``, ``cudaHostAlloc``,
  ``cudaStreamSynchronize``, cuDNN plan builds show up here).

    python benchmarks/profile_zorro_step.py --shape 256/128/8 --out $OUT        # H200, ~1 min
    python benchmarks/profile_zorro_step.py --model tiny:qwen3 --shape 32/16/4 \\
        --arms naive,padded,auto --device cpu                                    # CPU, seconds

``--scan P/R/GxN,...`` instead times the arms without the profiler, interleaved (round r runs
every arm once, in turn, so drift of the host's speed hits every arm alike) over ``--rounds``
rounds, per shape (``xN``: N groups in the batch), and reports medians and ratios to the first
arm — the measurement that places the point where ZoRRo starts to pay::

    python benchmarks/profile_zorro_step.py --scan 128/128/8x1,256/128/8x1,256/128/8x4 \\
        --arms naive,padded,auto --rounds 7 --out $OUT                          # H200

An arm suffixed ``+fused`` (``naive+fused``) runs the same step with the model's RMSNorms fused
(``polynya.fused.fuse_model``), one suffixed ``+compiled`` with the decoder layers' sub-modules
compiled (``polynya.compiled_layers.compile_layers``); both are toggled outside the timed region,
on the same model and batch (an arm's first calls, untimed, pay the compile). ``--fused`` /
``--compiled`` add ``<arm>+fused`` / ``<arm>+compiled`` after every arm::

    python benchmarks/profile_zorro_step.py --shape 384/0/8 --arms naive --fused --out $OUT
    python benchmarks/profile_zorro_step.py --scan 256/128/8x1,256/128/8x4 --arms naive,auto \\
        --fused --rounds 9 --out $OUT                                           # H200
    python benchmarks/profile_zorro_step.py --scan 256/128/8x1,256/128/8x4 --arms naive,auto \\
        --compiled --rounds 9 --out $OUT                                        # H200
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_zorro import make_batch, step_fn  # noqa: E402
from common import busy_ms, environment, save  # noqa: E402

from polynya.compiled_layers import compile_layers, uncompile_layers  # noqa: E402
from polynya.fused import fuse_model, unfuse_model  # noqa: E402
from polynya.models import load_model  # noqa: E402

SUFFIXES = {"fused": fuse_model, "compiled": compile_layers}


def arm_parts(arm: str) -> tuple[str, str | None]:
    """``"naive+fused"`` -> ``("naive", "fused")``; any other suffix than ``SUFFIXES`` is refused."""
    base, plus, rest = arm.partition("+")
    if plus and rest not in SUFFIXES:
        raise ValueError(f"unknown arm suffix in {arm!r}: only {', '.join('+' + k for k in SUFFIXES)}")
    return base, rest or None


def set_fused(model, arm: str) -> None:
    """Put the model in the arm's mode (fused norms, compiled layers, or plain), outside timing."""
    unfuse_model(model)
    uncompile_layers(model)
    mode = arm_parts(arm)[1]
    if mode:
        SUFFIXES[mode](model)


def arm_list(args) -> list[str]:
    arms = args.arms.split(",")
    for arm in arms:
        arm_parts(arm)
    extra = [k for k in SUFFIXES if getattr(args, k)]
    return [x for arm in arms for x in (arm, *(f"{arm}+{k}" for k in extra))]


def profile_arm(model, batch, arm: str, iters: int, device: str) -> dict:
    set_fused(model, arm)
    fn = step_fn(model, batch, arm_parts(arm)[0])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    wall = (time.perf_counter() - t0) * 1e3 / iters
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        sync()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kernel = collections.Counter()
    for e in kernels:
        by_kernel[e.name[:90]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    cpu = collections.Counter()
    calls = collections.Counter()
    for e in prof.key_averages():
        cpu[e.key[:90]] = e.self_cpu_time_total
        calls[e.key[:90]] = e.count
    return dict(arm=arm, wall_ms=round(wall, 2),
                gpu_busy_ms=round(busy_ms(kernels) / iters, 2) if kernels else None,
                kernels_per_step=len(kernels) // iters,
                top_kernels=[(k, round(v / 1e3 / iters, 3)) for k, v in by_kernel.most_common(15)],
                top_cpu=[(k, round(v / 1e3 / iters, 3), calls[k] // iters) for k, v in cpu.most_common(25)])


def scan(model, args) -> None:
    """``--scan``: interleaved wall times per shape and arm (module docstring)."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    arms = arm_list(args)
    rows = []
    for item in args.scan.split(","):
        shape, _, groups = item.partition("x")
        P, R, G = map(int, shape.split("/"))
        batch = make_batch(P, R, G, int(groups or 1), model.config.vocab_size, seed=P + R + G)
        fns = {arm: step_fn(model, batch, arm_parts(arm)[0]) for arm in arms}
        for arm, fn in fns.items():  # warm-up: compiles, plans, allocator
            set_fused(model, arm)
            fn(), fn()
        times = {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm, fn in fns.items():
                set_fused(model, arm)
                model.zero_grad(set_to_none=True)
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[arm].append((time.perf_counter() - t0) * 1e3)
        med = {arm: sorted(t)[len(t) // 2] for arm, t in times.items()}
        row = dict(shape=f"P{P}/R{R}/G{G}x{int(groups or 1)}",
                   naive_tokens=int(groups or 1) * G * (P + R),
                   zorro_tokens=int(groups or 1) * (P + G * R),
                   **{f"{a}_ms": round(m, 1) for a, m in med.items()},
                   **{f"{a}_vs_{arms[0]}": round(med[arms[0]] / m, 2) for a, m in med.items() if a != arms[0]},
                   times={a: [round(x, 1) for x in t] for a, t in times.items()})
        rows.append(row)
        print({k: v for k, v in row.items() if k != "times"}, flush=True)
        save(dict(environment(), model=args.model, arms=arms, rounds=args.rounds,
                  checkpointing=not args.no_checkpointing, rows=rows), args.out, "profile_zorro_scan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="256/128/8", help="P/R/G")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--arms", default="naive,padded,split")
    ap.add_argument("--fused", action="store_true",
                    help="also run every arm with fused RMSNorms (<arm>+fused)")
    ap.add_argument("--compiled", action="store_true",
                    help="also run every arm with compiled decoder layers (<arm>+compiled)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--scan", default=None, help="P/R/GxN,...: interleaved timing instead of profiles")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model = load_model(args.model, dtype=dtype, device=args.device)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if args.scan:
        scan(model, args)
        return
    P, R, G = map(int, args.shape.split("/"))
    batch = make_batch(P, R, G, args.groups, model.config.vocab_size, seed=P + R + G)
    rows = []
    for arm in arm_list(args):
        model.zero_grad(set_to_none=True)
        row = profile_arm(model, batch, arm, args.iters, args.device)
        rows.append(row)
        print(f"\n== {arm}: wall {row['wall_ms']} ms/step, GPU busy {row['gpu_busy_ms']} ms, "
              f"{row['kernels_per_step']} kernels/step", flush=True)
        for k, v in row["top_kernels"][:10]:
            print(f"   gpu {v:8.3f} ms  {k}")
        for k, v, n in row["top_cpu"][:18]:
            print(f"   cpu {v:8.3f} ms  x{n:<6d} {k}")
    save(dict(environment(), model=args.model, shape=args.shape, groups=args.groups,
              checkpointing=not args.no_checkpointing, rows=rows), args.out,
         f"profile_zorro_step_{P}_{R}_{G}")


if __name__ == "__main__":
    main()

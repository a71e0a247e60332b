"""Host time of one native-sampler decode step, with each host-side change on and off side by side
in one process (issue 15 goal 1: a decode step <= 3 ms at 64 sequences, P256, Qwen3-0.6B shape).

One engine (one copy of the weights) runs every arm; between arms only the switch under test
changes. Each arm generates ``groups`` prompts x ``G`` samples (64 sequences by default), fresh
prompts per run so the prefix cache cannot help, temperature 1, no stop tokens (``--stop-every``
adds a stop token that ends rows at different steps). Per arm it reports:

- ``ms_per_step``: wall time per decode step (the engine's ``decode_time_s / decode_steps``);
- ``wait_ms``: of that, time the host spent blocked on the step's tokens (the device's share);
- ``host_ms``: the rest — host work the device did not hide;
- per phase, host ms per decode step (inclusive wall time of the engine's own methods:
  scheduling, input building + forward launch, sampling launch, ahead preparation, booking;
  prefill steps' forwards excluded, their scheduling and booking not);
- ``critical_ms`` (async arm): host time per step launched ahead from its predecessor's tokens
  being back to its forward being launched (stop checks, pages, inputs, graph replay) — the
  host's part of the device's idle gap;
- on CUDA, GPU kernel time per decode step (``torch.profiler``) and the gap ``ms_per_step -
  kernel_ms``: device idle time per step.

Arms: ``sync`` (``async_scheduling=False``: schedule, launch, wait, book in turn) and ``async``
(the next decode step prepared while the device runs the current one and launched as soon as
its tokens are back). The CPU run (tiny model) exercises the same code but overlaps nothing (the
forward runs inside ``forward_launch`` there); ``--stub-forward`` leaves only the host's work.

    python benchmarks/bench_decode_host.py --groups 8 --G 8 --prompt-len 256 --new-tokens 128
    -> results/bench_decode_host.json, results/bench_decode_host.png
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from collections import defaultdict

import torch
from common import add_sampler_shape_args, make_prompts
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine

PHASES = {  # label -> (object attribute path on the backend, method)
    "schedule": ("scheduler", "schedule"),
    "forward_launch": ("runner", "run"),
    "sample_launch": (None, "_sample"),
    "prepare_ahead": (None, "_prepare_ahead"),
    "launch_ahead": (None, "_launch_ahead"),
    "launch_early": (None, "_launch_early"),
    "wait_tokens": ("_readback", "result"),
    "book": (None, "_postprocess"),
}


class PhaseTimer:
    """Wraps the engine's methods to add up their wall time (no device sync: host time)."""

    def __init__(self, backend) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.outer: list[str] = []  # labels being timed, outermost first
        self.originals = []
        for label, (attr, name) in PHASES.items():
            obj = backend if attr is None else getattr(backend, attr)
            fn = getattr(obj, name)
            self.originals.append((obj, name, fn))
            setattr(obj, name, self._wrap(label, fn))

    def _wrap(self, label, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            self.outer.append(label)
            try:
                return fn(*a, **k)
            finally:
                self.outer.pop()
                dt = time.perf_counter() - t0
                prefill = label == "forward_launch" and a[1]  # runner.run(seqs, is_prefill, ...)
                self.t["prefill_forward" if prefill else label] += dt
                if label == "sample_launch" and "launch_ahead" in self.outer:
                    self.t["sample_launch_in_ahead"] += dt
        return timed

    def restore(self) -> None:
        for obj, name, fn in self.originals:
            if name in vars(type(obj)) and getattr(fn, "__self__", None) is obj:
                delattr(obj, name)  # was the class's method: the instance attribute goes
            else:
                setattr(obj, name, fn)  # was an instance attribute already (a stub)


def params(args, vocab: int) -> SamplingParams:
    stops = ()
    if args.stop_every:  # a token that each sample draws with probability ~1/stop_every per step
        stops = tuple(range(100, 100 + max(1, (vocab - 200) // args.stop_every)))
    return SamplingParams(n=args.G, temperature=1.0, max_tokens=args.new_tokens, stop_token_ids=stops, seed=0)


def run_arm(engine: SamplingEngine, args, prompts, timer: PhaseTimer | None = None) -> dict:
    backend = engine.backend
    before = engine.stats()
    if timer is not None:
        timer.t.clear()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params(args, backend.runner.vocab_size))
    wall = time.perf_counter() - t0
    after = engine.stats()
    d = {k: after[k] - before[k] for k in ("decode_steps", "decode_time_s", "decode_tokens", "ahead_steps",
                                           "prefill_time_s")}
    steps = d["decode_steps"]
    d["wall_s"] = wall
    d["ms_per_step"] = 1e3 * d["decode_time_s"] / steps
    d["tokens"] = sum(len(s.token_ids) for o in out for s in o)
    if timer is not None:
        d["phases_ms_per_step"] = {k: 1e3 * v / steps for k, v in timer.t.items() if k != "prefill_forward"}
        ph = d["phases_ms_per_step"]
        in_ahead = ph.pop("sample_launch_in_ahead", 0.0)
        d["wait_ms"] = ph.get("wait_tokens", 0.0)
        d["host_ms"] = d["ms_per_step"] - d["wait_ms"]
        if "launch_ahead" in ph:  # host work between a step's tokens and the next forward's launch
            d["critical_ms"] = (ph["launch_ahead"] - in_ahead) * d["decode_steps"] / max(d["ahead_steps"], 1)
    return d


def stub_decode_forward(runner) -> None:
    """Decode steps do the runner's host work (inputs, FCA decision) and return fixed logits."""
    from polynya.engines.sample.native.decode_inputs import DecodeInputs

    real = runner.run
    logits = torch.randn(1024, runner.vocab_size, device=runner.device)

    def run(seqs, is_prefill, inputs=None, device_ids=None):
        if is_prefill:
            return real(seqs, is_prefill)
        if inputs is None:
            inputs = DecodeInputs.build(seqs, runner.block_size)
        inputs.astuple()
        runner.last_step_fca = runner.use_fca_for(seqs)
        return logits[:len(seqs)]

    runner.run = run


def kernel_ms_per_step(engine: SamplingEngine, args, prompts) -> float:
    from torch.profiler import ProfilerActivity, profile

    before = engine.stats()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params(args, engine.backend.runner.vocab_size))
    steps = engine.stats()["decode_steps"] - before["decode_steps"]
    total_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return total_us / 1e3 / steps  # prefill kernels included: an upper bound per decode step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    add_sampler_shape_args(ap)
    ap.add_argument("--stop-every", type=int, default=0,
                    help="add stop tokens so a row stops after ~this many steps on average (0: none)")
    ap.add_argument("--no-fca", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="print a cProfile of one run per arm")
    ap.add_argument("--stub-forward", action="store_true",
                    help="decode steps build their inputs but skip the model (fixed random logits): "
                         "the host's own cost, measurable on a CPU")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = args.groups * args.G
    cfg = SamplerConfig(args.model, dtype=args.dtype, block_size=args.block_size, fca=not args.no_fca,
                        max_num_seqs=max(rows, 8), kv_cache_memory_gb=4.0 if cuda else 0.5,
                        max_model_len=args.prompt_len + args.new_tokens + args.block_size)
    engine = SamplingEngine(cfg)
    backend = engine.backend
    vocab = backend.runner.vocab_size
    if args.stub_forward:
        stub_decode_forward(backend.runner)
    arms = {"sync": False, "async": True}
    results = {"config": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu", "arms": {}}
    for name, on in arms.items():  # warm-up: graphs captured, kernels compiled, for both arms
        backend.async_scheduling = on
        run_arm(engine, args, make_prompts(args.groups, args.prompt_len, vocab, seed=1000 + on))
    seed = 0
    for name, on in arms.items():
        backend.async_scheduling = on
        runs = []
        for _ in range(args.repeats):
            seed += 1
            timer = PhaseTimer(backend)
            try:
                runs.append(run_arm(engine, args, make_prompts(args.groups, args.prompt_len, vocab, seed), timer))
            finally:
                timer.restore()
        best = sorted(runs, key=lambda r: r["ms_per_step"])[len(runs) // 2]  # the median run
        best["ms_per_step_runs"] = [r["ms_per_step"] for r in runs]
        if cuda:
            seed += 1
            best["kernel_ms"] = kernel_ms_per_step(engine, args, make_prompts(args.groups, args.prompt_len, vocab, seed))
            best["device_idle_ms"] = best["ms_per_step"] - best["kernel_ms"]
        if args.cprofile:
            seed += 1
            prof = cProfile.Profile()
            prof.enable()
            run_arm(engine, args, make_prompts(args.groups, args.prompt_len, vocab, seed))
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
            print(f"--- cProfile, arm {name}\n{s.getvalue()[:5000]}", flush=True)
        results["arms"][name] = best
        phases = "  ".join(f"{k} {v:.3f}" for k, v in best["phases_ms_per_step"].items())
        extra = f"  kernels {best['kernel_ms']:.3f}  device idle {best['device_idle_ms']:.3f}" if cuda else ""
        if "critical_ms" in best:
            extra += f"  critical path {best['critical_ms']:.3f}"
        print(f"{name:5s}: {best['ms_per_step']:.3f} ms/step (runs {statistics.median(best['ms_per_step_runs']):.3f} "
              f"median of {len(runs)}), host {best['host_ms']:.3f} + wait {best['wait_ms']:.3f}{extra}; "
              f"ahead steps {best['ahead_steps']}/{best['decode_steps']}\n       per step: {phases}", flush=True)
    s, a = results["arms"]["sync"], results["arms"]["async"]
    results["speedup"] = s["ms_per_step"] / a["ms_per_step"]
    print(f"async scheduling: {s['ms_per_step']:.3f} -> {a['ms_per_step']:.3f} ms/step "
          f"({results['speedup']:.2f}x)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_decode_host.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, args, os.path.join(args.out, "bench_decode_host.png"))


def plot(results: dict, args, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    names = list(results["arms"])
    host = [results["arms"][n]["host_ms"] for n in names]
    wait = [results["arms"][n]["wait_ms"] for n in names]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(names, wait, label="host blocked on the step's tokens")
    ax.bar(names, host, bottom=wait, label="host work not hidden by the device")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{args.model}: {args.groups}x{args.G} sequences, P{args.prompt_len}, "
                 f"{args.new_tokens} new ({results['device']})", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

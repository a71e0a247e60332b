"""Where the recipe's generate phase spends its time, against a direct ``generate`` of the same
shape in the same process (issue 15, goal 2). Not a benchmark of record: a profile.

    python benchmarks/profile_generate.py --model random-qwen3-0.6b --steps 4

Runs ``--steps`` GRPO steps of the composed recipe (colocated, ZoRRo+FCA) through the public
client, timing inside each generate phase: the hand-over (trainer offload, sampler wake), the
sampler's prefill / decode / CUDA-graph captures; then calls the same sampler directly on the
last step's prompts (no hand-over) a few times; then a cProfile of one recipe generate and a
``torch.profiler`` GPU-time count of direct decode steps.
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

import torch
from hydra import compose, initialize_config_module
from polynya import SamplingParams, create_rl_client
from polynya.engines.sample.native import cuda_graph
from polynya.recipes.driver import GRPODriver
from polynya.recipes.schema import register

T: dict[str, float] = {}
N: dict[str, int] = {}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(obj, name: str, key: str) -> None:
    """Wrap ``obj.name`` to add its wall time (device synchronised) to ``T[key]``."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        _sync()
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _sync()
            T[key] = T.get(key, 0.0) + time.perf_counter() - t
            N[key] = N.get(key, 0) + 1

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random-qwen3-0.6b")
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-vmm", action="store_true", help="plain KV allocations (no cuda.bindings)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.no_vmm:
        from polynya.engines.sample.native import kv_memory
        kv_memory._driver = lambda: None
    register()
    overrides = [f"task={args.task}", f"model={args.model}", "placement=local", f"run.steps={args.steps}",
                 f"run.max_new_tokens={args.max_new_tokens}", "run.out_dir=/tmp/profile_generate",
                 "run.resume=false", "run.progress=false", "client.train.loss_config.kl_coef=0.001"]
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        cfg = compose("config", overrides=overrides)
    driver = GRPODriver(cfg)
    client = create_rl_client(driver.client_config)
    sampler = client.samplers[0]
    print("KV memory stable:", sampler.backend.runner._kv_memory.stable, flush=True)
    timed(client.trainer, "offload", "trainer_offload")
    timed(client.trainer, "onload", "trainer_onload")
    timed(sampler, "wake", "sampler_wake")
    timed(sampler, "sleep", "sampler_sleep")
    timed(sampler.backend, "generate", "sampler_generate")
    timed(cuda_graph.DecodeGraphs, "_capture", "graph_capture")
    report = {"steps": []}
    for step in range(args.steps):
        T.clear(), N.clear()
        s0 = sampler.stats()
        m = driver.step(client, step)
        s1 = sampler.stats()
        row = {k: round(m[k], 4) for k in ("generate_s", "logprobs_s", "train_s", "sync_s", "step_s")}
        row.update({k: round(v, 4) for k, v in T.items()}, counts=dict(N))
        row.update({k: round(s1[k] - s0[k], 4) for k in ("prefill_time_s", "decode_time_s", "decode_steps",
                                                        "prefill_tokens", "cache_hit_tokens",
                                                        "graph_captures", "graph_capture_s")})
        report["steps"].append(row)
        print("step", step, json.dumps(row), flush=True)

    prompts = [driver.prompt_ids[i] for i in driver._pick(args.steps - 1)]
    rc = driver.run_cfg
    params = SamplingParams(n=rc.group_size, temperature=driver.client_config.train.temperature, max_tokens=rc.max_new_tokens,
                            seed=123)
    client.generate(prompts, params)  # hand-over done; the sampler stays awake below
    direct = []
    for i in range(3):
        T.clear()
        s0 = sampler.stats()
        _sync()
        t = time.perf_counter()
        sampler.generate(prompts, params)
        _sync()
        s1 = sampler.stats()
        direct.append({"wall_s": time.perf_counter() - t, **{k: round(s1[k] - s0[k], 4) for k in (
            "prefill_time_s", "decode_time_s", "decode_steps", "graph_captures")}, **T})
        print("direct", i, direct[-1], flush=True)
    report["direct"] = direct

    # cProfile of one recipe generate phase (after a full step: the hand-over happens again)
    batch_step = driver.step(client, args.steps)
    print("extra step", {k: round(v, 4) for k, v in batch_step.items() if k.endswith("_s")}, flush=True)
    prof = cProfile.Profile()
    prof.enable()
    client.generate(prompts, params)
    _sync()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
    print(s.getvalue()[:9000], flush=True)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:5000], flush=True)

    if torch.cuda.is_available():  # GPU time per decode step vs wall per decode step
        from torch.profiler import ProfilerActivity, profile

        short = SamplingParams(n=rc.group_size, temperature=1.0, max_tokens=33, seed=5)
        sampler.generate(prompts, short)
        s0 = sampler.stats()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            sampler.generate(prompts, short)
        s1 = sampler.stats()
        steps = s1["decode_steps"] - s0["decode_steps"]
        kern = [e for e in p.key_averages() if e.device_type.name == "CUDA"]
        gpu_ms = sum(e.self_device_time_total for e in kern) / 1e3
        print(f"profiled: {steps} decode steps, wall/step {1e3 * (s1['decode_time_s'] - s0['decode_time_s']) / steps:.3f} ms,"
              f" GPU kernel time {gpu_ms:.1f} ms total (prefill included)", flush=True)
        print(p.key_averages().table(sort_by="self_device_time_total", row_limit=25), flush=True)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    client.shutdown()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_generate{'_novmm' if args.no_vmm else ''}.json"), "w") as f:
        json.dump(report, f, indent=2)
    g = [r["generate_s"] for r in report["steps"][1:]]
    d = [r["wall_s"] for r in direct[1:]]
    print(f"recipe generate median {statistics.median(g):.3f}s, direct {statistics.median(d):.3f}s, "
          f"ratio {statistics.median(g) / statistics.median(d):.2f}", flush=True)


if __name__ == "__main__":
    main()

"""Native sampler decode throughput with FCA on vs off (one GPU, one run, same model weights).

Workload (issue 5): ``groups`` prompts of ``prompt_len`` random tokens, ``G`` samples each,
``new_tokens`` generated (no stop tokens), temperature 1 — once with G=16 (the samples of a
prompt share its prefill pages) and once with G=1 (nothing shared). For each it reports decode
tokens/s, time per decode step, and the prefill tokens actually computed (must equal
``groups * prompt_len``: one prefill per prompt). One engine (one copy of the weights) runs
both arms, FCA switched on the model runner between runs; each arm gets fresh prompts so the
prefix cache cannot help it. Every (batch, FCA) CUDA graph is captured and every Triton kernel
compiled in a warm-up on other prompts, so the timed runs measure the steady state.

``--compile both`` adds the decode step compiled by ``torch.compile`` (``SamplerConfig.
compile_decode``) as a second engine in the same process (same seed: the same weights; its own
KV cache of ``--kv-gb``), timed interleaved with the eager one; each arm reports its compiles,
compile seconds and graph captures from the warm-up, and the greedy tokens of the two arms are
compared (``--check-greedy``). The goal shape of issue 15 (64 sequences, P256)::

    python benchmarks/bench_sampler.py --groups 8 --G 8 --prompt-len 256 --new-tokens 128 \
        --Gs 8 --compile both --kv-gb 8 --out benchmarks/results

Compiled arms fuse their projections (``SamplerConfig.fuse_projections``, the engine's default
with a compiled step); ``--fuse off`` runs them with separate GEMMs, ``--fuse both`` runs each
compiled arm both ways (``<arm>`` unfused, ``<arm>-fused``).
``--fca-profiles 2048x1,1024x2`` runs every arm once per FCA profile, ``<chunk tokens>x<shared
programs per SM>`` (``SamplerConfig.fca_chunk_tokens`` / ``fca_shared_progs_per_sm``; default:
the engine's), as one more engine each, arms named ``<arm>-fca<profile>`` when
there are several (the paged cells of all of them run the same kernel: a drift control).
``--fca-min-shared-tokens 0`` takes FCA on every step that shares pages (the engine's
threshold otherwise sends small-sharing steps to the paged kernel, so both cells would time it).
``--repeat N`` runs every cell N times in ABBA order and keeps each cell's median run.
``--replot results.json`` redraws a run's PNG from its JSON. ``--early both`` times every
case also with ``launch_before_readback`` off (each decode
step launched once the previous step's tokens are back), ``*_late`` rows and the ratio.

``--compile-scope`` picks what the compiled arm compiles (``SamplerConfig.compile_scope``):
one decoder layer reused by every layer (``layers``, the default), the whole model
(``model``), or ``both``: one compiled engine per scope, arms ``compiled-layers`` and
``compiled-model`` side by side (compile seconds from the warm-up, step times per case; with
``--check-greedy`` every arm's greedy tokens against the first arm's). Run each arm's compile
on a cold Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` fresh) to see the first-use cost. A CPU
smoke run::

    python benchmarks/bench_sampler.py --model tiny:qwen3 --dtype float32 --groups 2 --G 2 \
        --prompt-len 32 --new-tokens 8 --kv-gb 0.01 --compile both --compile-scope both \
        --out /tmp/bench_sampler

    python benchmarks/bench_sampler.py --out benchmarks/results
    -> results/bench_sampler.json, results/bench_sampler.png
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import numpy as np
import torch
from common import make_prompts
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine


def run_case(engine: SamplingEngine, prompts: list[list[int]], G: int, new_tokens: int) -> dict:
    before = engine.stats()
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(n=G, temperature=1.0, max_tokens=new_tokens,
                                                  stop_token_ids=(), seed=0))
    wall = time.perf_counter() - t0
    after = engine.stats()
    d = {k: after[k] - before[k] for k in ("prefill_tokens", "decode_tokens", "decode_steps",
                                           "decode_time_s", "prefill_time_s", "cache_hit_tokens",
                                           "preemptions", "early_steps", "ahead_steps",
                                           "fca_steps",  # the path each cell really timed
                                           # first-use costs inside a timed run (should be 0)
                                           "graph_captures", "graph_capture_s", "compiles",
                                           "compile_s")}
    assert all(len(s.token_ids) == new_tokens for o in out for s in o)
    d["wall_s"] = wall
    # A run of one new token has no decode step (prefill emits it): no rate to report.
    timed = d["decode_steps"] > 0 and d["decode_time_s"] > 0
    d["decode_tok_per_s"] = d["decode_tokens"] / d["decode_time_s"] if timed else float("nan")
    d["ms_per_step"] = 1e3 * d["decode_time_s"] / d["decode_steps"] if timed else float("nan")
    return d


EARLY = {"on": (True,), "off": (False,), "both": (False, True)}
ATTENTION_KERNELS = ("_fca_attend_kernel", "_paged_decode_kernel", "_merge_partials_kernel",
                     "_fca_classes_kernel", "_plan_")


def attention_ms_per_step(engine: SamplingEngine, prompts: list[list[int]], G: int, steps: int = 16) -> float:
    """GPU time of the decode-attention kernels (FCA / paged / merge / planner) per decode step,
    from a profiled short run (prefill uses SDPA kernels, which are not counted)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        r = run_case(engine, prompts, G, steps + 1)
    total_us = 0.0
    for e in prof.key_averages():
        if any(k in e.key for k in ATTENTION_KERNELS):
            total_us += getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
    return total_us / 1e3 / r["decode_steps"]


def device_kernels(engine: SamplingEngine, prompts: list[list[int]], G: int,
                   new_tokens: int) -> dict[str, tuple[int, float]]:
    """Per device operation name (kernels, copies, memsets; inside CUDA-graph replays too):
    ``(count, device ms)`` that ``torch.profiler`` sees in one generate call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_case(engine, prompts, G, new_tokens)
    return {e.key: (e.count, e.self_device_time_total / 1e3) for e in prof.key_averages()
            if str(e.device_type).endswith("CUDA")}


def decode_kernels_per_step(engine: SamplingEngine, args, G: int, vocab: int,
                            steps: int = 16, top: int = 15) -> dict:
    """Device operations and their device time per decode step: a run with ``steps`` decode
    steps minus the same run with none (prefill + first token only), both on fresh prompts of
    the same shape, per operation name; the total and the ``top`` by time."""
    long = device_kernels(engine, make_prompts(args.groups, args.prompt_len, vocab, seed=3001 + G), G, steps + 1)
    short = device_kernels(engine, make_prompts(args.groups, args.prompt_len, vocab, seed=3002 + G), G, 1)
    per = {k: ((n - short.get(k, (0, 0.0))[0]) / steps, (ms - short.get(k, (0, 0.0))[1]) / steps)
           for k, (n, ms) in long.items()}
    ranked = sorted(per.items(), key=lambda kv: -kv[1][1])
    return {"ops": sum(n for n, _ in per.values()), "ms": sum(ms for _, ms in per.values()),
            "top": [[k[:100], round(n, 2), round(ms, 4)] for k, (n, ms) in ranked[:top]]}


def greedy_check(engine: SamplingEngine, vocab: int, tokens: int) -> dict:
    """Greedy tokens of the engine (n=2 forks, FCA on and off) vs HF ``generate`` on the same
    module switched to SDPA: per prompt, how many leading tokens agree."""
    runner = engine.backend.runner
    g = np.random.default_rng(7)
    longest = engine.backend.max_model_len - tokens - 1
    prompts = [g.integers(100, vocab - 100, size=min(n, longest)).tolist() for n in (37, 300, 129, 513)]
    runner.model.set_attn_implementation("sdpa")
    ref = []
    for p in prompts:
        ids = torch.tensor([p], device=runner.device)
        out = runner.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    runner.model.set_attn_implementation("polynya_paged")
    report = {}
    for fca in (True, False):
        runner.use_fca = fca
        out = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=tokens, stop_token_ids=()))
        report["fca" if fca else "paged"] = [
            [next((i for i, (a, b) in enumerate(zip(r, s.token_ids)) if a != b), tokens) for s in o]
            for r, o in zip(ref, out)]
    print(f"greedy agreement with HF generate (leading tokens of {tokens}, per prompt x fork): {report}",
          flush=True)
    return report


ARMS = {"on": (True,), "off": (False,), "both": (True, False)}
SCOPES = {"layers": ("layers",), "model": ("model",), "both": ("layers", "model")}


def parse_profiles(spec: str) -> list[tuple[int, int]]:
    """``"2048x1,1024x2"`` -> ``[(2048, 1), (1024, 2)]`` (chunk tokens, shared programs / SM)."""
    out = []
    for item in spec.split(","):
        chunk, _, progs = item.strip().partition("x")
        if not (chunk.isdigit() and progs.isdigit() and int(chunk) > 0 and int(progs) > 0):
            raise SystemExit(f"--fca-profiles: {item!r} is not <chunk tokens>x<programs per SM>, "
                             "e.g. 2048x1")
        out.append((int(chunk), int(progs)))
    return out


def arms(compile_: str, scope: str, fuse: str = "off",
         profiles: list[tuple[int, int]] | None = None) -> dict[str, dict]:
    """``{arm name: SamplerConfig overrides}``: ``compiled`` / ``eager``, the compiled arm as
    ``compiled-<scope>`` per scope when ``scope`` is both; ``fuse`` on: compiled arms with
    ``fuse_projections``, both: each compiled arm also as ``<arm>-fused``; with several FCA
    ``profiles``, every arm once per profile as ``<arm>-fca<chunk>x<progs>``."""
    out = {}
    for c in ARMS[compile_]:
        if not c:
            out["eager"] = {"compile_decode": False}
        elif len(SCOPES[scope]) == 1:
            out["compiled"] = {"compile_decode": True, "compile_scope": SCOPES[scope][0]}
        else:
            out.update({f"compiled-{s}": {"compile_decode": True, "compile_scope": s}
                        for s in SCOPES[scope]})
    for name in [n for n in out if n != "eager"]:
        base = out[name]
        for f in ARMS[fuse]:
            out[name + "-fused" if fuse == "both" and f else name] = dict(base, fuse_projections=f)
    if not profiles:
        return out
    if len(profiles) == 1:
        chunk, progs = profiles[0]
        return {n: dict(kw, fca_chunk_tokens=chunk, fca_shared_progs_per_sm=progs)
                for n, kw in out.items()}
    return {f"{n}-fca{chunk}x{progs}": dict(kw, fca_chunk_tokens=chunk, fca_shared_progs_per_sm=progs)
            for n, kw in out.items() for chunk, progs in profiles}


def warm_up(engine: SamplingEngine, name: str, args, cases: list[int], vocab: int) -> dict:
    """Capture each (batch, fca) graph and compile (Triton kernels, the compiled step) on
    other prompts; returns what that cost."""
    runner = engine.backend.runner
    t0 = time.perf_counter()
    for fca in (True, False):
        runner.use_fca = fca
        for G in cases:
            run_case(engine, make_prompts(args.groups, args.prompt_len, vocab, seed=1000 + 10 * G + fca), G, 8)
    st = engine.stats()
    out = {"warmup_s": time.perf_counter() - t0, "compiles": st["compiles"], "compile_s": st["compile_s"],
           "compile_scope": st["compile_scope"], "compile_scope_reason": st["compile_scope_reason"],
           "fused_groups": st["fused_groups"], "fused_calls": st["fused_calls"],
           "graph_captures": st["graph_captures"], "graph_capture_s": st["graph_capture_s"],
           "compile_error": runner.compiled.error if runner.compiled is not None else None,
           "max_model_len": engine.backend.max_model_len,  # block tables' width x the page
           "fca_min_shared_tokens": engine.config.fca_min_shared_tokens}
    print(f"{name} warm-up: {out}", flush=True)
    return out


def arms_agree(engines: dict, vocab: int, tokens: int) -> dict:
    """Greedy tokens of every other arm vs the first (n=2 forks, FCA on and off): per prompt
    x fork, how many leading tokens agree (bf16 may flip a near-tie); keyed ``"<arm> vs
    <first>"`` (just ``fca`` / ``paged`` with two arms, as before)."""
    g = np.random.default_rng(5)  # no timed case's seed (10 * G + fca): no prefix-cache hits there
    longest = next(iter(engines.values())).backend.max_model_len - tokens - 1
    prompts = [g.integers(100, vocab - 100, size=min(n, longest)).tolist() for n in (37, 300, 129)]
    outs: dict[str, dict] = {name: {} for name in engines}
    for fca in (True, False):
        for name, engine in engines.items():
            engine.backend.runner.use_fca = fca
            outs[name]["fca" if fca else "paged"] = engine.generate(
                prompts, SamplingParams(n=2, temperature=0, max_tokens=tokens, stop_token_ids=()))
    first, *others = engines
    report = {}
    for name in others:
        report[f"{name} vs {first}"] = {
            path: [[next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), tokens)
                    for x, y in zip(ox, oy)] for ox, oy in zip(outs[name][path], outs[first][path])]
            for path in ("fca", "paged")}
    print(f"greedy agreement (leading tokens of {tokens}): {report}", flush=True)
    return next(iter(report.values())) if len(report) == 1 else report


def time_cells(engine: SamplingEngine, name: str, G: int, args, vocab: int) -> dict:
    """Every (early launch, FCA) cell of one case, ``args.repeat`` times in ABBA order (the
    cell order reversed on every other repetition, so a slow first cell cannot favour one
    arm); each cell keeps the run with its median step time and every run's ``ms_per_step``."""
    runner = engine.backend.runner
    cells = [(early, fca) for early in EARLY[args.early] for fca in (True, False)]
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeat):
        for early, fca in (cells if rep % 2 == 0 else cells[::-1]):
            engine.backend.launch_before_readback = early
            runner.use_fca = fca  # fresh prompts per run: each computes its own prefill
            seed = 10 * G + fca + 5 * (not early) + 10007 * rep  # no warm-up or profile seed
            r = run_case(engine, make_prompts(args.groups, args.prompt_len, vocab, seed=seed),
                         G, args.new_tokens)
            assert r["prefill_tokens"] == args.groups * args.prompt_len, r
            runs.setdefault(("fca" if fca else "paged") + ("" if early else "_late"), []).append(r)
            print(f"G={G:3d} {name:8} fca={fca!s:5} early={early!s:5}: "
                  f"{r['decode_tok_per_s']:10.0f} tok/s  {r['ms_per_step']:7.3f} ms/step  "
                  f"early steps {r['early_steps']}/{r['decode_steps']}  prefill "
                  f"{r['prefill_tokens']} tok in {r['prefill_time_s']:.2f}s  preemptions "
                  f"{r['preemptions']}  captures {r['graph_captures']} compiles "
                  f"{r['compiles']}", flush=True)
    engine.backend.launch_before_readback = True
    row = {}
    for key, rs in runs.items():
        ordered = sorted(rs, key=lambda r: r["ms_per_step"])
        row[key] = dict(ordered[(len(ordered) - 1) // 2],
                        runs_ms_per_step=[r["ms_per_step"] for r in rs])
    if args.early == "both":
        for path in ("fca", "paged"):
            row[f"{path}_early_speedup"] = (row[f"{path}_late"]["ms_per_step"]
                                            / row[path]["ms_per_step"])
            print(f"G={G} {name} {path}: steps launched before the read-back "
                  f"{row[f'{path}_early_speedup']:.3f}x as fast (medians of {args.repeat})",
                  flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--G", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-gb", type=float, default=24.0, help="KV cache per engine (arm)")
    ap.add_argument("--Gs", type=int, nargs="+", default=None, help="cases to run (default: G and 1)")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--compile", choices=sorted(ARMS), default="on",
                    help="decode step compiled (SamplerConfig.compile_decode), eager, or both arms")
    ap.add_argument("--compile-scope", choices=sorted(SCOPES), default="layers",
                    help="what the compiled arm compiles (SamplerConfig.compile_scope): one decoder "
                         "layer for all, the whole model, or both (one compiled arm per scope)")
    ap.add_argument("--check-greedy", type=int, default=0, metavar="TOKENS",
                    help="first compare greedy tokens with HF generate on the same weights "
                         "(and, with several arms, every arm with the first)")
    ap.add_argument("--profile", action="store_true",
                    help="also time the decode attention kernels and count the device ops per "
                         "decode step (torch.profiler)")
    ap.add_argument("--fuse", choices=sorted(ARMS), default="on",
                    help="compiled arms with SamplerConfig.fuse_projections (q/k/v and gate/up "
                         "as one GEMM each; on by default, as in the engine); off: separate "
                         "GEMMs; both: each compiled arm both ways ('<arm>', '<arm>-fused')")
    ap.add_argument("--early", choices=sorted(EARLY), default="on",
                    help="launch decode steps before the previous step's tokens are back "
                         "(SamplingEngine.launch_before_readback); both: each case both ways")
    ap.add_argument("--fca-profiles", default=None,
                    help="FCA profiles <chunk tokens>x<shared programs per SM>, comma-separated "
                         "(SamplerConfig.fca_chunk_tokens / fca_shared_progs_per_sm); several: "
                         "every arm once per profile")
    ap.add_argument("--fca-min-shared-tokens", type=int, default=None, metavar="TOKENS",
                    help="SamplerConfig.fca_min_shared_tokens for every arm (default: the "
                         "engine's); 0 = FCA on every step that shares pages, to time it below "
                         "the threshold")
    ap.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                    help="SamplerConfig.max_model_len (default: prompt + new tokens + a page, "
                         "the narrowest block tables; 0: the engine's default, the model's "
                         "positions as a recipe's sampler has them — FCA's plan walks tables "
                         "that wide every step)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per cell, in ABBA order; each cell reports its median run")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a results JSON")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.replot:
        with open(args.replot) as f:
            results = json.load(f)
        saved = argparse.Namespace(**results["config"])
        plot(results, saved, saved.Gs or [saved.G, 1], args.replot.replace(".json", ".png"))
        return
    cases = args.Gs or [args.G, 1]
    os.makedirs(args.out, exist_ok=True)

    cfg = SamplerConfig(args.model, dtype=args.dtype, block_size=args.block_size, fca=True,
                        kv_cache_memory_gb=args.kv_gb, max_num_seqs=max(args.groups * max(cases), 8),
                        max_model_len=(args.prompt_len + args.new_tokens + args.block_size
                                       if args.max_model_len is None else args.max_model_len or None),
                        cuda_graphs=not args.no_graphs)
    if args.fca_min_shared_tokens is not None:
        cfg = replace(cfg, fca_min_shared_tokens=args.fca_min_shared_tokens)
    # one engine per arm (same seed: same weights); FCA toggled on each model runner per run
    engines = {name: SamplingEngine(replace(cfg, **kw))
               for name, kw in arms(args.compile, args.compile_scope, args.fuse,
                                    parse_profiles(args.fca_profiles) if args.fca_profiles
                                    else None).items()}
    first = next(iter(engines.values()))
    vocab = first.backend.runner.vocab_size
    results = {"config": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "arms": {}}
    if args.check_greedy:
        results["greedy_check"] = greedy_check(first, vocab, args.check_greedy)
    for name, engine in engines.items():
        results["arms"][name] = warm_up(engine, name, args, cases, vocab)
    if args.check_greedy and len(engines) >= 2:
        results["arms_agree"] = arms_agree(engines, vocab, args.check_greedy)

    for G in cases:
        for name, engine in engines.items():  # arms interleaved per case
            runner = engine.backend.runner
            row = time_cells(engine, name, G, args, vocab)
            row["speedup"] = row["fca"]["decode_tok_per_s"] / row["paged"]["decode_tok_per_s"]
            print(f"G={G} {name}: FCA decode speedup {row['speedup']:.2f}x", flush=True)
            results["arms"][name][f"G{G}"] = row
            if args.profile:
                for fca in (True, False):
                    runner.use_fca = fca
                    prompts = make_prompts(args.groups, args.prompt_len, vocab, seed=2000 + 10 * G + fca)
                    attn = attention_ms_per_step(engine, prompts, G, steps=min(16, args.new_tokens - 1))
                    row["fca" if fca else "paged"]["attention_ms_per_step"] = attn
                    print(f"G={G:3d} {name:8} fca={fca!s:5}: decode attention kernels "
                          f"{attn:.3f} ms/step", flush=True)
                    if torch.cuda.is_available():
                        k = decode_kernels_per_step(engine, args, G, vocab, steps=min(16, args.new_tokens - 1))
                        row["fca" if fca else "paged"]["device_ops_per_step"] = k["ops"]
                        row["fca" if fca else "paged"]["decode_kernels"] = k
                        print(f"G={G:3d} {name:8} fca={fca!s:5}: {k['ops']:.0f} device ops, "
                              f"{k['ms']:.3f} ms of device time per decode step; the most:", flush=True)
                        for kname, n, ms in k["top"]:
                            print(f"    {ms:8.4f} ms {n:6.1f}x  {kname}", flush=True)
        compare_arms(results["arms"], G)
        results[f"G{G}"] = results["arms"][next(iter(engines))][f"G{G}"]  # first arm
    with open(os.path.join(args.out, "bench_sampler.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, args, cases, os.path.join(args.out, "bench_sampler.png"))


def compare_arms(arms_: dict, G: int) -> None:
    """Print each compiled arm's step-time ratio to the eager arm, and the layer scope's to the
    model scope's (>1: the first is faster)."""
    pairs = [(c, "eager") for c in arms_ if c.startswith("compiled") and "eager" in arms_]
    if {"compiled-layers", "compiled-model"} <= set(arms_):
        pairs.append(("compiled-layers", "compiled-model"))
    pairs += [(a, a[:-len("-fused")]) for a in arms_ if a.endswith("-fused")]
    first = next(iter(arms_))  # FCA profiles: every other profile against the first arm's
    if "-fca" in first:
        stem = first.rsplit("-fca", 1)[0]
        pairs += [(a, first) for a in arms_ if a != first and a.rsplit("-fca", 1)[0] == stem]
    for fast, slow in pairs:
        for path in ("fca", "paged"):
            ratio = arms_[slow][f"G{G}"][path]["ms_per_step"] / arms_[fast][f"G{G}"][path]["ms_per_step"]
            print(f"G={G} {path}: {fast} decode step {ratio:.2f}x as fast as {slow}", flush=True)


def plot(results: dict, args, cases: list[int], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    labels = [f"G={g}" for g in cases]
    first = results["arms"][next(iter(results["arms"]))][f"G{cases[0]}"]
    paths = [p for p in ("paged", "fca", "paged_late", "fca_late") if p in first]
    names = {"paged": "paged decode", "fca": "FCA", "paged_late": "paged decode, launched after "
             "the read-back", "fca_late": "FCA, launched after the read-back"}
    bars = [(f"{arm} {names[path]}", [results["arms"][arm][f"G{g}"][path]["ms_per_step"] for g in cases])
            for arm in results["arms"] for path in paths]
    x = np.arange(len(cases))
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, values) in enumerate(bars):
        ax.bar(x - 0.4 + width * (i + 0.5), values, width, label=label)
    ax.set_xticks(x, labels)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{args.model} {args.dtype} (decode {args.compile}, scope {args.compile_scope})\n"
                 f"{args.groups} prompts x G, P{args.prompt_len}, {args.new_tokens} new", fontsize=9)
    ax.legend(fontsize=7, loc="lower center", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

"""One GRPO recipe end to end on one device: step time split into generate / logprobs / train /
sync, with ZoRRo + FCA on vs off, through the public client (local protocol, colocated).

    python benchmarks/bench_recipe.py --model random-qwen3-0.6b --task gsm8k --steps 10
    -> results/bench_recipe_<task>.json (per-step rows of both arms), results/bench_recipe_<task>.png

Each arm builds its own client (trainer with ZoRRo on/off, reference log-prob engine, native
sampler with FCA on/off) and runs ``--steps`` GRPO steps of the composed recipe, step by step
as ``GRPODriver.run`` does, recording every step (new prompt lengths every step: the per-step
times show what new shapes cost) and the sampler's counters per step (prefill / decode time,
CUDA-graph captures, FCA steps). Medians are over the steps after the first (which pays
compilation and CUDA-graph capture), a ``--profile-step`` left out (the profiler slows it);
``--replot JSON`` re-summarises a saved run with these rules and redraws its PNG.

In the same process, right after its steps, each arm calls the same sampler directly
(``SamplingEngine.generate``, no hand-over) on fresh prompts of the task with the recipe's
sampling parameters — the *direct* generate of the same shape — so the recipe's generate phase
can be compared with it (``generate / direct``). The difference is the colocated hand-over
(trainer offload, sampler wake) and anything else the phase pays outside the sampler.
``--budget-s`` stops before starting an arm that would not fit (the table shows what ran).
The ZoRRo-off arm's engines run ``zorro=False`` in ``--naive-layout`` (default ``auto``: packed
samples without padding, FlashAttention-2 varlen, as verl's remove-padding; ``padded`` gives the
previous one-row-per-sample baseline for reference). ``--fused`` runs both arms' trainer and
log-prob engine with ``fused_kernels=True`` (compare with a run without it), ``--compiled`` with
``compile_layers=True`` (``polynya.compiled_layers``; the first step pays the compile), and
``--offload`` sets ``client.offload_trainer`` (default ``auto``, the client's default: the trainer
stays on the device when the sampler's room is free there; ``true``: always offloaded; ``false``,
also ``--keep-trainer``: never); each arm reports how many hand-overs moved the trainer
(``trainer_offloads``); ``--set KEY=VALUE`` adds a Hydra override to every arm (e.g. an FCA
profile: ``client.sampling.fca_chunk_tokens=1024``). ``--arms`` picks the arms, in
order (default ``zorro,naive``); ``+compiled`` compiles one arm's layers, so
``--arms zorro,naive,zorro+compiled,naive+compiled`` measures the compiled layers' gain in one
process (each ZoRRo+FCA arm is compared with the naive+paged arm of its compile mode, each
compiled arm with its eager twin)::

    python benchmarks/bench_recipe.py --model tiny --steps 2 --prompts 2 --group-size 2 \
        --max-new-tokens 8 --arms zorro,naive+compiled --out /tmp/br     # CPU smoke, no numbers

``--profile-step N`` runs step N's trainer calls (``forward_backward``, ``step``) under
``torch.profiler`` (``common.profile_call``) and keeps, in that step's row, wall vs GPU-busy ms,
kernels, the caching allocator's ``cudaMalloc`` / ``cudaFree`` / retry counts and the top host
calls: where the training phase's time goes inside the recipe (memory shared with the sampler
and the log-prob engine) rather than in a bare benchmark.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, profile_call, save  # noqa: E402

import torch  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402

from polynya import SamplingParams, create_rl_client  # noqa: E402
from polynya.recipes.driver import GRPODriver  # noqa: E402
from polynya.recipes.schema import register  # noqa: E402

PHASES = ("generate_s", "logprobs_s", "train_s", "sync_s")
SAMPLER = ("prefill_time_s", "decode_time_s", "decode_steps", "fca_steps", "graph_captures",
           "graph_capture_s", "prefill_tokens")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


ARM_NAMES = {"zorro": (True, "ZoRRo+FCA"), "naive": (False, "naive+paged")}


def parse_arms(spec: str, compiled: bool) -> list[tuple[str, bool, bool]]:
    """``--arms`` (``zorro,naive``, each optionally ``+compiled``) -> (label, ZoRRo+FCA on,
    compiled layers); ``--compiled`` compiles every arm."""
    arms = []
    for item in spec.split(","):
        base, plus, mode = item.partition("+")
        if base not in ARM_NAMES or (plus and mode != "compiled"):
            raise SystemExit(f"--arms: unknown arm {item!r}; use zorro / naive, optionally +compiled")
        on, label = ARM_NAMES[base]
        comp = compiled or bool(plus)
        arms.append((label + (" compiled" if comp and not compiled else ""), on, comp))
    if len({a[0] for a in arms}) != len(arms):
        raise SystemExit(f"--arms: an arm is listed twice in {spec!r}")
    return arms


def compose_recipe(args, on: bool, compiled: bool, out: str):
    overrides = [f"task={args.task}", f"model={args.model}", "placement=local",
                 f"run.steps={args.steps}", f"run.prompts_per_step={args.prompts}",
                 f"run.group_size={args.group_size}", f"run.max_new_tokens={args.max_new_tokens}",
                 f"run.out_dir={out}/{'on' if on else 'off'}{'-compiled' if compiled else ''}",
                 "run.resume=false", "run.progress=false",
                 f"client.zorro_train={on}", f"client.fca={on}",
                 f"client.train.naive_layout={args.naive_layout}",
                 f"client.logprob.naive_layout={args.naive_layout}",
                 "client.train.loss_config.kl_coef=0.001", "client.train.gradient_checkpointing=true",
                 f"client.train.fused_kernels={args.fused}", f"client.logprob.fused_kernels={args.fused}",
                 f"client.train.compile_layers={compiled}", f"client.logprob.compile_layers={compiled}",
                 f"client.offload_trainer={'false' if args.keep_trainer else args.offload}",
                 *args.set]
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        return compose("config", overrides=overrides)


def direct_generate(driver: GRPODriver, client, first_step: int, calls: int) -> list[dict]:
    """The sampler called directly (already awake, the hand-over done) on the prompts of steps
    the run did not use, with the recipe's sampling parameters."""
    rc = driver.run_cfg
    client.sleep("sampler")  # hand the device to the sampler once, outside the timings
    client.wake("sampler")
    sampler = client.samplers[0]
    rows = []
    for i in range(calls):
        step = first_step + i
        prompts = [driver.prompt_ids[j] for j in driver._pick(step)]
        params = SamplingParams(n=rc.group_size, temperature=driver.client_config.train.temperature, top_p=rc.top_p,
                                top_k=rc.top_k, max_tokens=rc.max_new_tokens, seed=rc.seed + step)
        before = sampler.stats()
        _sync()
        t = time.perf_counter()
        out = sampler.generate(prompts, params)
        _sync()
        wall = time.perf_counter() - t
        after = sampler.stats()
        rows.append({"wall_s": wall, "tokens": sum(len(s.token_ids) for g in out for s in g),
                     **{k: after[k] - before[k] for k in SAMPLER}})
    return rows


def profile_trainer(trainer) -> dict:
    """Shadow the trainer's ``forward_backward`` and ``step`` with profiled calls for one step;
    their profiles land in the returned dict (the caller deletes the shadows after the step)."""
    profiles = {}

    def wrap(name):
        method = getattr(trainer, name)

        def call(*a, **kw):
            out, profiles[name] = profile_call(lambda: method(*a, **kw))
            return out
        return call

    trainer.forward_backward, trainer.step = wrap("forward_backward"), wrap("step")
    return profiles


def run_arm(args, arm: tuple[str, bool, bool], out: str) -> tuple[dict, list[dict]]:
    label, on, compiled = arm
    t0 = time.perf_counter()
    driver = GRPODriver(compose_recipe(args, on, compiled, out))
    steps = []
    with create_rl_client(driver.client_config) as client:
        sampler = client.samplers[0]
        for step in range(args.steps):
            before = sampler.stats()
            profiles = profile_trainer(client.trainer) if step == args.profile_step else None
            m = driver.step(client, step)
            if profiles is not None:
                del client.trainer.forward_backward, client.trainer.step  # the class's again
            after = sampler.stats()
            row = {"step": step, **{k: m[k] for k in (*PHASES, "step_s")},
                   "response_len": m["response_len"], "reward_mean": m["reward_mean"],
                   # which layout the trainer's micro-batches ran (ZoRRo's "auto" may pick packed)
                   "micro_batches": m.get("micro_batches"), "zorro_micro_batches": m.get("zorro_micro_batches"),
                   # of train_s, the trainer's forward/backward; the rest is its optimizer step
                   "forward_backward_s": m.get("time_s"),
                   **{k: after[k] - before[k] for k in SAMPLER}}
            row["handover_s"] = row["generate_s"] - row["prefill_time_s"] - row["decode_time_s"]
            if profiles:
                row["train_profile"] = profiles
            steps.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        offloads = client.handover.offloads  # hand-overs of the recipe's steps that moved it
        direct = direct_generate(driver, client, args.steps + 1, args.direct_calls)
        client.wake("trainer")  # how much of the trainer's device memory the hand-over frees
        freed = client.trainer.offload() if client.trainer.config.zero_stage > 0 else None
    base = {"arm": label, "zorro_fca": on, "compiled": compiled, "wall_s": round(time.perf_counter() - t0, 1),
            "offload_freed_fraction": round(freed["freed_fraction"], 3) if freed else None,
            "trainer_offloads": offloads, "offload_trainer": str(driver.client_config.offload_trainer)}
    return summarize(base, steps, direct), [dict(r, arm=label) for r in steps] + [
        dict(r, arm=label, direct=True) for r in direct]


def summarize(base: dict, steps: list[dict], direct: list[dict]) -> dict:
    """An arm's row: ``base`` (what only the live run knows) and the medians of its steps after
    the first, leaving out a profiled step (``--profile-step``: the profiler slows it)."""
    steady = [r for r in steps[1:] if "train_profile" not in r] or steps[1:] or steps
    med = lambda key, rows=steady: statistics.median(r[key] for r in rows)  # noqa: E731
    summary = {k: base[k] for k in ("arm", "zorro_fca", "compiled", "wall_s")}
    summary["median_of_steps"] = [r["step"] for r in steady]
    for k in (*PHASES, "step_s", "handover_s"):
        summary[k.replace("_s", "_ms")] = round(1e3 * med(k), 1)
    summary["decode_ms_per_step"] = round(1e3 * med("decode_time_s") / med("decode_steps"), 2)
    summary["direct_generate_ms"] = round(1e3 * med("wall_s", direct[1:] or direct), 1)
    summary["generate_vs_direct"] = round(summary["generate_ms"] / summary["direct_generate_ms"], 3)
    summary["fca_steps"] = sum(r["fca_steps"] for r in steps)
    summary["decode_steps"] = sum(r["decode_steps"] for r in steps)
    summary["graph_captures"] = sum(r["graph_captures"] for r in steps)
    summary.update({k: base[k] for k in ("offload_freed_fraction", "trainer_offloads", "offload_trainer")})
    summary["reward"] = round(statistics.mean(r["reward_mean"] for r in steps), 3)
    return summary


def compare(rows: list[dict]) -> None:
    """Each ZoRRo+FCA arm against the naive+paged arm of its compile mode, each compiled arm
    against its eager twin (ratios added to the rows)."""
    for row in rows:
        base = next((r for r in rows if not r["zorro_fca"] and r["compiled"] == row["compiled"]), None)
        if row["zorro_fca"] and base is not None:
            for key in ("step_ms", "generate_ms", "train_ms", "logprobs_ms"):
                row[f"speedup_{key[:-3]}"] = round(base[key] / row[key], 3)
        eager = next((r for r in rows if r["zorro_fca"] == row["zorro_fca"] and not r["compiled"]), None)
        if row["compiled"] and eager is not None:
            row["compiled_vs_eager_step"] = round(eager["step_ms"] / row["step_ms"], 3)


def replot(path: str) -> None:
    """Re-summarise a saved run's per-step rows (this script's current rules) into its JSON and
    redraw its PNG next to it."""
    import json

    with open(path) as f:
        saved = json.load(f)
    rows = []
    for old in saved["rows"]:
        mine = [r for r in saved["per_step"] if r["arm"] == old["arm"]]
        rows.append(summarize(old, [r for r in mine if not r.get("direct")], [r for r in mine if r.get("direct")]))
    compare(rows)
    saved.update(rows=rows, resummarized_by="bench_recipe.py --replot")
    with open(path, "w") as f:
        json.dump(saved, f, indent=2)
    args = argparse.Namespace(**{k: saved[k] for k in ("task", "prompts", "group_size", "max_new_tokens", "model")})
    plot(rows, saved["per_step"], args, saved, os.path.splitext(path)[0] + ".png")
    report(rows)


def report(rows: list[dict]) -> None:
    print(markdown_table(rows, [("arm", "arm"), ("generate_ms", "generate ms"),
                                ("direct_generate_ms", "direct generate ms"),
                                ("generate_vs_direct", "generate / direct"), ("handover_ms", "hand-over ms"),
                                ("decode_ms_per_step", "decode ms/step"), ("logprobs_ms", "logprobs ms"),
                                ("train_ms", "train ms"), ("sync_ms", "sync ms"), ("step_ms", "step ms"),
                                ("fca_steps", "FCA steps"), ("graph_captures", "captures"),
                                ("trainer_offloads", "trainer offloads"),
                                ("reward", "mean reward"), ("wall_s", "arm wall s")]))
    for row in rows:
        if "speedup_step" in row:
            print(f"step speedup {row['arm']} vs naive+paged: {row['speedup_step']:.3f}x "
                  f"(generate {row['speedup_generate']:.3f}x, train {row['speedup_train']:.3f}x, "
                  f"logprobs {row['speedup_logprobs']:.3f}x; median of steps {row['median_of_steps']})")
        if "compiled_vs_eager_step" in row:
            print(f"{row['arm']}: compiled layers {row['compiled_vs_eager_step']:.3f}x its eager step")


def plot(rows: list[dict], per_step: list[dict], args, env: dict, path: str) -> None:
    """Left: median step of each arm stacked by phase. Right: every step's time per arm."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.4]})
    colors = {"generate_ms": "#4c72b0", "logprobs_ms": "#dd8452", "train_ms": "#55a868", "sync_ms": "#c44e52"}
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for key, color in colors.items():
        vals = [r[key] for r in rows]
        ax.bar(x, vals, 0.55, bottom=bottom, color=color, label=key.replace("_ms", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    direct = [r["direct_generate_ms"] for r in rows]
    ax.scatter(x, direct, marker="_", s=900, color="black", zorder=3, label="direct generate")
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{r['step_ms']:.0f} ms", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["arm"].replace(" ", "\n") for r in rows], fontsize=8)
    ax.set_ylabel("median step (ms; steps after the first, unprofiled)")
    ax.set_ylim(0, 1.12 * max(bottom + direct))
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    for arm, marker in zip((r["arm"] for r in rows), "osD^"):
        pts = [r for r in per_step if r["arm"] == arm and not r.get("direct")]
        ax2.plot([p["step"] for p in pts], [1e3 * p["step_s"] for p in pts], marker=marker, label=f"{arm} step")
        ax2.plot([p["step"] for p in pts], [1e3 * p["generate_s"] for p in pts], marker=marker,
                 linestyle="--", alpha=0.6, label=f"{arm} generate")
        for p in pts:
            if "train_profile" in p:
                ax2.annotate("profiled", (p["step"], 1e3 * p["step_s"]), fontsize=7,
                             textcoords="offset points", xytext=(4, 4))
    ax2.set_yscale("log")
    ax2.set_xlabel("step (new prompts and lengths every step)")
    ax2.set_ylabel("ms")
    ax2.legend(fontsize=7)
    ratios = ", ".join(f"{r['arm']} {r['speedup_step']:.2f}x" for r in rows if "speedup_step" in r)
    fig.suptitle(f"bench_recipe {args.task}: {args.prompts} prompts x G{args.group_size}, "
                 f"{args.max_new_tokens} new, {args.model}, colocated — {env['gpu']}"
                 + (f" — vs naive+paged: {ratios}" if ratios else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random-qwen3-0.6b")
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--direct-calls", type=int, default=3, help="direct generate calls (first one not counted)")
    ap.add_argument("--naive-layout", default="auto", choices=("auto", "packed", "padded"),
                    help="layout of the ZoRRo-off arm's engines (auto: packed varlen on GPU)")
    ap.add_argument("--fused", action="store_true",
                    help="both arms' trainer and log-prob engine with fused RMSNorm + RoPE kernels")
    ap.add_argument("--arms", default="zorro,naive",
                    help="zorro (ZoRRo+FCA) / naive (naive+paged), each optionally +compiled")
    ap.add_argument("--compiled", action="store_true",
                    help="every arm's trainer and log-prob engine with compiled decoder layers")
    ap.add_argument("--offload", default="auto", choices=("auto", "true", "false"),
                    help="client.offload_trainer (auto: offloaded only when the sampler lacks room)")
    ap.add_argument("--keep-trainer", action="store_true", help="same as --offload false")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--profile-step", type=int, default=-1,
                    help="profile this step's trainer calls (module docstring)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more Hydra override for every arm, e.g. "
                         "client.sampling.fca_chunk_tokens=1024 (repeatable)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--replot", metavar="JSON", help="re-summarise a saved run and redraw its PNG; runs nothing")
    args = ap.parse_args()
    if args.replot:
        return replot(args.replot)
    register()
    arms = parse_arms(args.arms, args.compiled)
    start, rows, per_step = time.perf_counter(), [], []
    for arm in arms:
        if rows and time.perf_counter() - start > args.budget_s - rows[-1]["wall_s"]:
            print(f"skipping the {arm[0]} arm: it would not fit in --budget-s", flush=True)
            break
        summary, steps = run_arm(args, arm, os.path.join(args.out, "recipe_runs"))
        rows.append(summary)
        per_step += steps
        print(summary, flush=True)
    env = environment()
    compare(rows)
    save(dict(env, **vars(args), rows=rows, per_step=per_step), args.out, f"bench_recipe_{args.task}")
    plot(rows, per_step, args, env, os.path.join(args.out, f"bench_recipe_{args.task}.png"))
    report(rows)


if __name__ == "__main__":
    main()

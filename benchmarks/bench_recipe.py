"""One GRPO recipe end to end on one device: step time split into generate / logprobs / train /
sync, with ZoRRo + FCA on vs off, through the public client (local protocol, colocated).

    python benchmarks/bench_recipe.py --model random-qwen3-0.6b --task gsm8k --steps 3

Each arm builds its own client (trainer with ZoRRo on/off, reference log-prob engine, native
sampler with FCA on/off), runs ``--steps`` GRPO steps of the composed recipe, and reports the
median of the steps after the first (which pays compilation and CUDA-graph capture).
``--budget-s`` stops before starting an arm that would not fit (the table shows what ran).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, save  # noqa: E402

from hydra import compose, initialize_config_module  # noqa: E402

from polynya.recipes.driver import GRPODriver  # noqa: E402
from polynya.recipes.schema import register  # noqa: E402

KEYS = ("generate_s", "logprobs_s", "train_s", "sync_s", "step_s")


def run_arm(args, on: bool, out: str) -> dict:
    overrides = [f"task={args.task}", f"model={args.model}", "placement=local",
                 f"run.steps={args.steps}", f"run.prompts_per_step={args.prompts}",
                 f"run.group_size={args.group_size}", f"run.max_new_tokens={args.max_new_tokens}",
                 f"run.out_dir={out}/{'on' if on else 'off'}", "run.resume=false", "run.progress=false",
                 f"client.zorro_train={on}", f"client.zorro_inference={on}",
                 "client.train.loss_config.kl_coef=0.001", "client.train.gradient_checkpointing=true"]
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        cfg = compose("config", overrides=overrides)
    t = time.perf_counter()
    history = GRPODriver(cfg).run()["history"]
    row = {"arm": "ZoRRo+FCA" if on else "naive+paged", "wall_s": round(time.perf_counter() - t, 1)}
    steady = history[1:] or history
    for k in KEYS:
        row[k.replace("_s", "_ms")] = round(1e3 * statistics.median(h.get(k, 0.0) for h in steady), 1)
    row["reward"] = round(statistics.mean(h["reward_mean"] for h in history), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random-qwen3-0.6b")
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    register()
    start, rows = time.perf_counter(), []
    for on in (True, False):
        if rows and time.perf_counter() - start > args.budget_s - rows[-1]["wall_s"]:
            print(f"skipping the {'on' if on else 'off'} arm: it would not fit in --budget-s", flush=True)
            break
        rows.append(run_arm(args, on, os.path.join(args.out, "recipe_runs")))
        print(rows[-1], flush=True)
    save(dict(environment(), **vars(args), rows=rows), args.out, "bench_recipe")
    print(markdown_table(rows, [("arm", "arm"), ("generate_ms", "generate ms"), ("logprobs_ms", "logprobs ms"),
                                ("train_ms", "train ms"), ("sync_ms", "sync ms"), ("step_ms", "step ms"),
                                ("reward", "mean reward"), ("wall_s", "arm wall s")]))


if __name__ == "__main__":
    main()

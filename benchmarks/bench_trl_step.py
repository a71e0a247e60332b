"""A whole TRL GRPO step: ``polynya.adapters.trl.GRPOTrainer`` vs TRL's own ``GRPOTrainer``
(``use_vllm=False``: HF ``generate`` or transformers' continuous batching), same model, data,
reward and settings, one GPU.

    python benchmarks/bench_trl_step.py --shapes gsm8k       # H200: one shape per device call
    python benchmarks/bench_trl_step.py --shapes gsm8k --polynya-arms polynya,polynya-fused \\
        --trl-arms static                                      # H200: fused kernels on vs off
    python benchmarks/bench_trl_step.py --model tiny:qwen3 --prompt-tokens 32 \\
        --long-prompt-tokens 96 --max-new-tokens 8 --steps 2   # CPU smoke run of the script

Shapes (8 prompts x ``--group-size`` 8, ``--max-new-tokens`` 128 new tokens, random Qwen3-0.6B
shape in bf16 with the locally trained tokenizer): ``gsm8k`` (~``--prompt-tokens`` 256 distinct
tokens per prompt) and ``longqa`` (a ~``--long-prompt-tokens`` 3000-token context shared by all 8
prompts, then a short distinct question). TRL's settings for every arm: one optimizer step per
generation batch of 64 completions, ``per_device_train_batch_size=8`` (one group per
micro-batch) x ``gradient_accumulation_steps=8``, gradient checkpointing, ``beta=0``, a reward
that counts digits. Each arm runs ``--steps`` optimizer steps; the JSON reports the median step
after the first (CUDA events around each step, CUDA-synchronised), and the median time of the
generation call inside it (``_generate_single_turn``, timed by wrapping it on the instance here).
Random weights rarely emit EOS, so every arm generates the full ``--max-new-tokens`` per sample.

TRL arms (``--trl-arms``, all three by default): the no-vLLM generation settings a TRL user can
pick in ``GRPOConfig`` — ``dynamic`` (HF ``generate``, TRL's default), ``static``
(``cache_implementation="static"``; TRL always sets ``disable_compile=True``, and
``generation_kwargs`` cannot undo it, so it runs without torch.compile) and ``cb``
(``use_transformers_continuous_batching=True``: transformers' paged ``generate_batch``); and,
not by default, ``dynamic-compile`` (``torch_compile=True``: the training forward compiled by
transformers' Trainer; its first step took 128 s on the H200). The
polynya arms (``--polynya-arms``: ``polynya`` by default, the adapter with eager layers;
``polynya-fused`` with ``fused_kernels=True``, ``polynya-compiled`` with ``compile_layers=True``,
``polynya-default`` with the adapter's defaults) run first, then the TRL arms in ``--trl-arms`` order; each polynya arm's
speed-up is against the fastest TRL arm that ran (the table's per-TRL-arm column: the first's); an arm that fails is recorded with its error and the others still run;
the JSON is rewritten after every arm (``complete: false`` until the end), so a run cut short by
a time limit keeps what it measured.

Results: ``<--out>/bench_trl_step.json`` and ``.png`` (step ms per shape, fastest TRL arm vs
polynya).

GPU machine (Python 3.12, torch 2.11, transformers 5.17, no package index): TRL and what it
imports are carried as wheels in two calls (70 MB: pyarrow alone is 55 MB), then one call per
shape; ``benchmarks/carry/README.md`` has the script (``benchmarks/carry/trl-wheels.sh``) and the
exact device commands.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, paired_bars, save  # noqa: E402

import torch  # noqa: E402


def _text_of_tokens(tok, n: int, seed: int) -> str:
    """Text whose encoding is about ``n`` tokens (random non-special ids, decoded, re-encoded and
    cut at ``n``: decoding random ids merges and splits differently)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(tok.all_special_ids) + 4, len(tok) - 1, (n,), generator=g).tolist()
    return tok.decode(tok(tok.decode(ids))["input_ids"][:n])


def prompts_for(shape: str, args, tok) -> list[str]:
    if shape == "gsm8k":
        return [_text_of_tokens(tok, args.prompt_tokens, seed=i) for i in range(args.prompts)]
    context = _text_of_tokens(tok, args.long_prompt_tokens, seed=1000)
    return [context + f"\nQuestion {i}: " + _text_of_tokens(tok, 24, seed=2000 + i) for i in range(args.prompts)]


def reward_digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


class StepTimer:
    """Times optimizer steps (trainer callback) and the generation call (instance wrapper)."""

    def __init__(self, trainer, cuda: bool):
        from transformers import TrainerCallback

        self.cuda, self.steps, self.gens, self._t = cuda, [], [], 0.0
        timer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer._sync()
                timer._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                timer._sync()
                timer.steps.append(1e3 * (time.perf_counter() - timer._t))

        trainer.add_callback(_CB())
        inner = trainer._generate_single_turn

        def timed(*a, **k):
            self._sync()
            t = time.perf_counter()
            out = inner(*a, **k)
            self._sync()
            self.gens.append(1e3 * (time.perf_counter() - t))
            return out

        trainer._generate_single_turn = timed  # benchmark instrumentation only

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


# TRL's no-vLLM generation settings a user can pick (GRPOConfig fields): HF ``generate`` with the
# default dynamic cache, with a static cache (TRL always passes ``disable_compile=True``, so no
# torch.compile either way), and transformers' continuous batching (paged ``generate_batch``).
TRL_ARMS = {
    "dynamic": ("TRL (HF generate, dynamic cache)", {}),
    "static": ("TRL (HF generate, static cache)", {"cache_implementation": "static"}),
    "cb": ("TRL (transformers continuous batching)", {"use_transformers_continuous_batching": True}),
    # the training forward/backward through torch.compile (transformers' ``torch_compile``,
    # whole model), generation as ``dynamic``: the TRL counterpart of ``polynya-compiled``
    "dynamic-compile": ("TRL (HF generate, dynamic cache, torch_compile=True)", {"torch_compile": True}),
}

# polynya's arms (label, adapter options): the adapter with ZoRRo and eager layers
# (``bench_trl_step.py`` runs it by default), without ZoRRo (``zorro=False``: compute_logprobs'
# packed naive layout), with the fused RMSNorm kernels (``fused_kernels=True``), with compiled
# layers (``compile_layers=True``), and with the adapter's own defaults (``polynya-default``:
# ``compile_layers=None``, i.e. compiled on a GPU); ``--polynya-arms`` / ``profile_trl_step.py --arms``
_EAGER = {"compile_layers": False}
POLYNYA_ARMS = {"polynya": ("polynya adapter", {"zorro": True, **_EAGER}),
                "polynya-nozorro": ("polynya adapter, zorro=False", {"zorro": False, **_EAGER}),
                "polynya-fused": ("polynya adapter, fused kernels", {"zorro": True, "fused_kernels": True, **_EAGER}),
                "polynya-compiled": ("polynya adapter, compiled layers", {"zorro": True, "compile_layers": True}),
                "polynya-default": ("polynya adapter, defaults", {}),
                "polynya-nozorro-fused": ("polynya adapter, zorro=False, fused kernels",
                                          {"zorro": False, "fused_kernels": True, **_EAGER})}


def run_arm(arm: str, shape: str, args, model_dir: str, tok, cuda: bool) -> dict:
    import trl
    from datasets import Dataset

    from polynya.adapters.trl import GRPOTrainer
    from polynya.config import SamplerConfig

    ckpt = cuda if getattr(args, "gradient_checkpointing", None) is None else bool(args.gradient_checkpointing)
    config = trl.GRPOConfig(
        output_dir=os.path.join(args.out, "trl_runs", f"{arm}-{shape}"), max_steps=args.steps,
        per_device_train_batch_size=args.group_size, gradient_accumulation_steps=args.prompts,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens, temperature=1.0,
        learning_rate=1e-6, beta=0.0, gradient_checkpointing=ckpt, bf16=cuda and args.dtype == "bfloat16",
        use_cpu=not cuda, model_init_kwargs={"dtype": args.dtype}, logging_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True, seed=0, **TRL_ARMS.get(arm, ("", {}))[1])
    data = Dataset.from_list([{"prompt": p} for p in prompts_for(shape, args, tok)])
    common = dict(reward_funcs=reward_digits, args=config, train_dataset=data, processing_class=tok)
    if arm not in POLYNYA_ARMS:
        trainer = trl.GRPOTrainer(model_dir, **common)
    else:
        sampler = SamplerConfig(model_dir, dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_gb,
                                max_num_seqs=max(64, args.prompts * args.group_size))
        trainer = GRPOTrainer(model_dir, sampler_config=sampler, **POLYNYA_ARMS[arm][1], **common)
    timer = StepTimer(trainer, cuda)
    start = time.perf_counter()
    trainer.train()
    steady = lambda xs: xs[1:] or xs  # noqa: E731  (the first step pays compilation / graph capture)
    prompt_len = statistics.mean(len(tok(p)["input_ids"]) for p in data["prompt"])
    row = {"shape": shape, "arm": POLYNYA_ARMS[arm][0] if arm in POLYNYA_ARMS else TRL_ARMS[arm][0],
           "prompt_tokens": round(prompt_len), "step_ms": round(statistics.median(steady(timer.steps)), 1),
           "generate_ms": round(statistics.median(steady(timer.gens)), 1),
           "steps_ms": [round(x, 1) for x in timer.steps], "wall_s": round(time.perf_counter() - start, 1),
           "completion_len": trainer.state.log_history[-2].get("completions/mean_length")}
    if arm in POLYNYA_ARMS:
        row["sampler"] = {k: v for k, v in trainer.sampler.stats().items() if isinstance(v, (int, float))}
        row["compiled_layers"] = trainer.compiled_layers
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return row


def plot(best: list[tuple[str, float, float]], path: str) -> None:
    """Step ms per shape: the fastest TRL arm vs the polynya adapter (``best``: shape, TRL, ours)."""
    paired_bars(path, [b[0] for b in best], [b[1] for b in best], "fastest TRL arm",
                [b[2] for b in best], "polynya adapter", "GRPO step (ms)",
                title="TRL GRPOTrainer step, H200, Qwen3-0.6B shape bf16, 8 prompts x 8, 128 new tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--shapes", default="gsm8k,longqa")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--long-prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trl-arms", default="static,dynamic,cb",
                    help=f"TRL generation settings to run, of {sorted(TRL_ARMS)}; speed-ups are against "
                         "the fastest that ran")
    ap.add_argument("--polynya-arms", default="polynya",
                    help=f"adapter arms to run, of {sorted(POLYNYA_ARMS)}; the first is plotted")
    ap.add_argument("--kv-cache-gb", type=float, default=16.0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if not cuda:
        args.kv_cache_gb = min(args.kv_cache_gb, 0.25)

    from polynya.models import load_model, load_tokenizer

    model_dir = tempfile.mkdtemp(prefix="bench_trl_model_")
    load_model(args.model, dtype=args.dtype, seed=0).save_pretrained(model_dir)
    tok = load_tokenizer(args.model)
    tok.save_pretrained(model_dir)
    trl_arms = args.trl_arms.split(",")
    unknown = sorted(set(trl_arms) - set(TRL_ARMS))
    if unknown:
        raise SystemExit(f"--trl-arms: unknown {unknown}; choose from {sorted(TRL_ARMS)}")
    our_arms = args.polynya_arms.split(",")
    unknown = sorted(set(our_arms) - set(POLYNYA_ARMS))
    if unknown:
        raise SystemExit(f"--polynya-arms: unknown {unknown}; choose from {sorted(POLYNYA_ARMS)}")
    rows, best = [], []

    def checkpoint(complete: bool) -> str:  # after every arm: a timed-out run keeps what it measured
        return save(dict(environment(), **vars(args), complete=complete, rows=rows), args.out, "bench_trl_step")

    for shape in args.shapes.split(","):
        mine = []
        for arm in our_arms:
            mine.append(run_arm(arm, shape, args, model_dir, tok, cuda))
            rows.append(mine[-1])
            checkpoint(False)
        ours = mine[0]
        base = []
        for arm in trl_arms:
            base.append(try_arm(arm, shape, args, model_dir, tok, cuda))
            rows.append(base[-1])
            checkpoint(False)
        ran = [r for r in base if "error" not in r]
        if ran:
            fastest = min(ran, key=lambda r: r["step_ms"])
            for r in mine:
                r["baseline"] = fastest["arm"]
                r["speedup"] = round(fastest["step_ms"] / r["step_ms"], 2)
                r["generate_speedup"] = round(min(x["generate_ms"] for x in ran) / r["generate_ms"], 2)
            for r in ran:
                r["polynya_speedup"] = round(r["step_ms"] / ours["step_ms"], 2)
            best.append((shape, fastest["step_ms"], ours["step_ms"]))
        print(mine + base, flush=True)
    path = checkpoint(True)
    if best:
        plot(best, path.replace(".json", ".png"))
    for r in rows:
        for key in ("prompt_tokens", "generate_ms", "step_ms", "polynya_speedup", "speedup"):
            r.setdefault(key, "")
    print(markdown_table(rows, [("shape", "shape"), ("arm", "arm"), ("prompt_tokens", "prompt tokens"),
                                ("generate_ms", "generate ms"), ("step_ms", "step ms"),
                                ("polynya_speedup", "polynya step speed-up over this arm"),
                                ("speedup", "step speed-up over the fastest TRL arm")]))


def try_arm(arm: str, shape: str, args, model_dir: str, tok, cuda: bool) -> dict:
    """A TRL arm; one that fails (e.g. a setting this transformers cannot run) is reported as
    such instead of ending the benchmark."""
    try:
        return run_arm(arm, shape, args, model_dir, tok, cuda)
    except Exception as exc:  # noqa: BLE001 - recorded in the results, printed in full
        traceback.print_exc()
        if cuda:
            torch.cuda.empty_cache()
        return {"shape": shape, "arm": TRL_ARMS[arm][0], "error": f"{type(exc).__name__}: {exc}"[:500]}

if __name__ == "__main__":
    main()

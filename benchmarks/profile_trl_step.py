"""Where a TRL GRPO step's time goes: ``polynya.adapters.trl.GRPOTrainer`` vs TRL's own trainer.

Same model, data, reward and settings as ``bench_trl_step.py`` (its ``run_arm`` config), one
shape; each arm runs ``--steps`` optimizer steps and the steps after the first are reported per
phase: wall ms (CUDA-synchronised at each phase boundary), aten ops dispatched (every op is a
Python -> C++ -> kernel launch: at small shapes the step is host-bound, so the op count is what
costs), host reads of tensor data (``.item()`` / ``int()`` / device -> host copies: of CUDA
tensors on a GPU, where each is a sync; of any tensor on CPU), forward calls of decoder layer 0
and of the LM-head module (TRL's fused head and polynya's head bypass the module's forward).
The op count is taken by a ``TorchDispatchMode`` in the last step only (it slows the host).

Phases (each excludes the phases nested in it): ``generate`` (``_generate_single_turn``),
``score`` (the rest of ``_generate_and_score_completions``: rewards, advantages, any old /
reference log-probs), ``logprobs`` (``_get_per_token_logps_and_entropies``: the training
forward), ``loss`` (the rest of ``compute_loss``), ``backward`` (``accelerator.backward``),
``push`` (the adapter's weight push + checksum), ``other`` (the rest of the step: optimizer,
callbacks, batching).

    python benchmarks/profile_trl_step.py --arms polynya,polynya-nozorro,dynamic --out $OUT
                                        # H200: GSM8K shape, 3 arms, ~2.5 min (estimate)
    python benchmarks/profile_trl_step.py --arms polynya,polynya-fused --out $OUT
                                        # H200: the adapter with and without fused RMSNorms
    python benchmarks/profile_trl_step.py --arms polynya,dynamic --kernels --out $OUT
                                        # + torch.profiler of the counted step: kernel time
    python benchmarks/profile_trl_step.py --model tiny:qwen3 --prompt-tokens 32 \\
        --max-new-tokens 8 --prompts 2 --group-size 4 --steps 3   # CPU, seconds
    python benchmarks/profile_trl_step.py --layers 2 --prompt-tokens 64 --max-new-tokens 16 \\
        --prompts 2 --gradient-checkpointing 1 --steps 3          # CPU, 0.6B shape cut to 2 layers
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import bench_trl_step as bench
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {"aten._local_scalar_dense.default", "aten.item.default"}


class Counter(TorchDispatchMode):
    """Counts aten ops and host syncs, attributed to the phase open when they run."""

    def __init__(self):
        super().__init__()
        self.phase = "other"
        self.ops = collections.Counter()
        self.syncs = collections.Counter()
        self.by_name = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[self.phase] += 1
        self.by_name[self.phase][name] += 1
        if self._is_sync(name, args, kwargs or {}):
            self.syncs[self.phase] += 1
        return func(*args, **(kwargs or {}))


    @staticmethod
    def _is_sync(name: str, args, kwargs) -> bool:
        """A read of tensor data by the host: ``.item()`` / ``int()`` / ``.tolist()`` or a copy
        to the CPU — of a CUDA tensor when CUDA is in use (a device sync), of any tensor on a
        CPU-only run (the same calls, to count where they would sync)."""
        if name in _SYNC_OPS:
            return not torch.cuda.is_available() or _on_cuda(args)
        if name.startswith(("aten._to_copy", "aten.copy_")):
            to_cpu = str(kwargs.get("device", "")) == "cpu" or (
                name.startswith("aten.copy_") and isinstance(args[0], torch.Tensor) and not args[0].is_cuda)
            return to_cpu and _on_cuda(args[1:] if name.startswith("aten.copy_") else args)
        return False


def _on_cuda(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)


class Profiler:
    """Wraps the trainer's phase methods (on the instance) and counts per phase."""

    def __init__(self, trainer, cuda: bool):
        self.cuda, self.counter = cuda, Counter()
        self.ms = collections.Counter()
        self.calls = collections.Counter()
        self.layer_fwd = collections.Counter()
        self.head_calls = collections.Counter()
        self._stack: list[str] = []
        for name, phase in (("_generate_single_turn", "generate"),
                            ("_generate_and_score_completions", "score"),
                            ("_get_per_token_logps_and_entropies", "logprobs"),
                            ("compute_loss", "loss"),
                            ("push_weights", "push")):
            if hasattr(trainer, name):
                setattr(trainer, name, self._wrap(getattr(trainer, name), phase))
        acc = trainer.accelerator
        acc.backward = self._wrap(acc.backward, "backward")
        policy = acc.unwrap_model(trainer.model)
        layers = policy.model.layers
        layers[0].register_forward_pre_hook(lambda *a: self.layer_fwd.update([self.counter.phase]))
        policy.get_output_embeddings().register_forward_pre_hook(
            lambda *a: self.head_calls.update([self.counter.phase]))

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _wrap(self, fn, phase: str):
        def wrapped(*a, **k):
            with self.phase(phase):
                return fn(*a, **k)
        return wrapped

    @contextlib.contextmanager
    def phase(self, name: str):
        self._sync()
        outer = self.counter.phase
        self.counter.phase = name
        self.calls[name] += 1
        t = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            dt = 1e3 * (time.perf_counter() - t)
            self.ms[name] += dt
            if outer != "other":  # nested phases (generate in score, logprobs in loss) count once
                self.ms[outer] -= dt
            self.counter.phase = outer

    def reset_counts(self) -> None:
        for c in (self.calls, self.layer_fwd, self.head_calls, self.counter.ops, self.counter.syncs):
            c.clear()
        self.counter.by_name.clear()

    def snapshot(self) -> dict:
        return {"ms": dict(self.ms), "ops": dict(self.counter.ops), "syncs": dict(self.counter.syncs),
                "calls": dict(self.calls), "layer0_forwards": dict(self.layer_fwd),
                "lm_head_module_calls": dict(self.head_calls)}


class KernelTimes:
    """``torch.profiler`` over one step: the device time of every kernel, copy and memset
    (the device's rows only, each once) summed, and the ones that took the most."""

    def __init__(self, cuda: bool):
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()

    def stop(self, top: int = 30) -> dict:
        self.prof.__exit__(None, None, None)
        # device rows only: an aten op's row carries its kernels' time too (counted twice)
        rows = [(e.key, e.count, e.self_device_time_total / 1e3)
                for e in self.prof.key_averages()
                if str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
        rows.sort(key=lambda r: -r[2])
        return {"device_ms": round(sum(r[2] for r in rows), 1), "kernels": len(rows),
                "launches": sum(r[1] for r in rows),
                "top": [[k[:120], n, round(ms, 2)] for k, n, ms in rows[:top]]}


def profile_arm(arm: str, args, model_dir: str, tok, cuda: bool) -> dict:
    """Runs ``bench.run_arm`` with a ``Profiler`` on its trainer: wall ms per phase over the
    steps after the first but the last, op / sync / call counts in the last step only (the
    counting mode itself costs host time)."""
    from transformers import TrainerCallback

    built: dict = {}
    real_timer = bench.StepTimer

    class Hooked(real_timer):  # bench.run_arm builds the trainer and its timer; hook in there
        def __init__(self, trainer, cuda_):
            super().__init__(trainer, cuda_)
            built["prof"] = prof = Profiler(trainer, cuda_)
            last = args.steps - 1

            class _Marks(TrainerCallback):
                def on_step_begin(self, a, state, control, **kw):
                    prof._sync()
                    built["t0"] = time.perf_counter()
                    if state.global_step == 1:
                        built["ms0"] = dict(prof.ms)
                    if state.global_step == last:
                        built["ms1"] = dict(prof.ms)
                        prof.reset_counts()
                        if args.kernels:
                            built["kernels"] = KernelTimes(cuda)
                        prof.counter.__enter__()
                        built["counting"] = True

                def on_step_end(self, a, state, control, **kw):
                    prof._sync()
                    if 1 <= state.global_step - 1 < last:  # the step that just ended was timed
                        built.setdefault("steps", []).append(1e3 * (time.perf_counter() - built["t0"]))
                    if built.pop("counting", False):
                        prof.counter.__exit__(None, None, None)
                        if "kernels" in built:
                            built["kernels"] = built["kernels"].stop()

            trainer.add_callback(_Marks())

    bench.StepTimer = Hooked
    try:
        row = bench.run_arm(arm, args.shape, args, model_dir, tok, cuda)
    finally:
        bench.StepTimer = real_timer
        if built.pop("counting", False):
            built["prof"].counter.__exit__(None, None, None)
    prof, n = built["prof"], args.steps - 2
    ms = {p: round((built["ms1"].get(p, 0) - built["ms0"].get(p, 0)) / n, 1) for p in built["ms1"]}
    step_ms = sum(built["steps"]) / len(built["steps"])
    ms["other"] = round(step_ms - sum(v for p, v in ms.items() if p != "other"), 1)
    counts = prof.snapshot()
    last = {k: v for k, v in counts.items() if k != "ms"}
    return {"arm": row["arm"], "step_ms": round(step_ms, 1), "generate_ms": ms.get("generate", 0.0),
            "ms": ms, "last_step": last, "kernels": built.get("kernels"),
            "top_ops": {p: prof.counter.by_name[p].most_common(8) for p in ("logprobs", "backward", "push", "other")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--shape", default="gsm8k", choices=("gsm8k", "longqa"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--long-prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="at least 3: warm-up, timed, counted")
    ap.add_argument("--arms", default="polynya,dynamic",
                    help=f"comma-separated, of {sorted(bench.POLYNYA_ARMS) + sorted(bench.TRL_ARMS)}")
    ap.add_argument("--kv-cache-gb", type=float, default=16.0)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--gradient-checkpointing", type=int, default=None,
                    help="1/0 (default: on with CUDA, as bench_trl_step.py)")
    ap.add_argument("--kernels", action="store_true",
                    help="also torch.profiler the counted step: total kernel time, top kernels")
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="profile_trl_"))
    args = ap.parse_args()
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3 (a warm-up step, timed steps, a counted step)")
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(bench.POLYNYA_ARMS) - set(bench.TRL_ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {sorted(bench.POLYNYA_ARMS) + sorted(bench.TRL_ARMS)}")
    cuda = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if not cuda:
        args.kv_cache_gb = min(args.kv_cache_gb, 0.25)
    from polynya.models import load_model, load_tokenizer

    model_dir = tempfile.mkdtemp(prefix="profile_trl_model_")
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    load_model(args.model, dtype=args.dtype, seed=0, **overrides).save_pretrained(model_dir)
    tok = load_tokenizer(args.model)
    tok.save_pretrained(model_dir)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "profile_trl_step.json")
    rows = []
    for arm in arms:  # the JSON after every arm: a run cut short keeps what it measured
        rows.append(profile_arm(arm, args, model_dir, tok, cuda))
        with open(path, "w") as f:
            json.dump({"args": vars(args), "cuda": cuda, "rows": rows,
                       "complete": len(rows) == len(arms)}, f, indent=1, default=str)
    keys = ("ops", "syncs", "calls", "layer0_forwards", "lm_head_module_calls")
    phases = ("generate", "score", "logprobs", "loss", "backward", "push", "other")
    print(f"ms: mean of steps 2..{args.steps - 1} (synchronised at phase boundaries); counts: step {args.steps}")
    for r in rows:
        print(f"\n== {r['arm']}: step {r['step_ms']} ms, of which not generation "
              f"{round(r['step_ms'] - r['generate_ms'], 1)} ms")
        print("phase".ljust(10) + "ms".rjust(10) + "".join(k.rjust(22) for k in keys))
        for p in phases:
            print(p.ljust(10) + str(r["ms"].get(p, 0)).rjust(10)
                  + "".join(str(r["last_step"][k].get(p, 0)).rjust(22) for k in keys))
        if r["kernels"]:
            k = r["kernels"]
            print(f"device time of the counted step's kernels: {k['device_ms']} ms "
                  f"({k['launches']} launches) against a step of {r['step_ms']} ms")
            for name, n, ms in k["top"][:15]:
                print(f"  {ms:9.2f} ms {n:6d}x  {name}")
    print(f"\nJSON (with the most frequent aten ops per phase): {path}")


if __name__ == "__main__":
    main()

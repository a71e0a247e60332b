"""verl's ``deepspeed`` backend (polynya's TrainingEngine) through verl's batch format: ZoRRo on
vs off — time of ``forward_backward_batch`` + ``optimizer_step`` and equality of the results.

Random-init Qwen3-0.6B shape (``random:qwen3-0.6b``), bf16, ZeRO-2, gradient checkpointing. For
each P/R/G shape, ``--groups`` prompts x G responses (ragged: lengths R/2..R) are built the way
verl's trainer builds an actor batch (padded ``DataProto`` -> ``left_right_2_no_padding``) and
trained with verl's own ``ppo_loss`` (vanilla PPO, token-mean). Both arms start from the same
weights; reported: median step seconds over ``--iters`` steps after one warm-up, the speedup,
and on the first step |loss| / grad-norm relative differences and the largest log-prob
difference (bf16: expect ~1e-2 relative, not bit equality).

Needs verl 0.9.1 importable (``pip install 'polynya[verl,deepspeed]'``: verl imports Ray and
tensordict at ``import verl``) and a CUDA GPU. The lent H200 has neither network nor Ray, and
Ray's wheel is larger than what can be carried there, so this script runs where the extra
installs (it exits with status 3 and says so otherwise). It runs on CPU too (``--device cpu``,
tiny shapes) as a smoke test.

    python benchmarks/bench_verl_engine.py --out benchmarks/results
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from functools import partial
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, ROOT)
from common import environment, markdown_table, median, paired_bars, save

SHAPES = [(1024, 512, 8), (256, 512, 8)]


def need_verl() -> None:
    try:
        import verl  # noqa: F401
        from polynya.adapters.verl.engine import DeepSpeedLMEngine  # noqa: F401
    except ImportError as exc:
        print(f"bench_verl_engine needs verl 0.9.1 and DeepSpeed: pip install 'polynya[verl,deepspeed]' ({exc})")
        sys.exit(3)


def make_batch(shape, groups: int, vocab: int, seed: int = 0):
    from tests.adapters.verl.verl_batches import verl_batch

    p, r, g = shape
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, uids = [], [], []
    for k in range(groups):
        prompt = torch.randint(2, vocab, (p,), generator=gen).tolist()
        for _ in range(g):
            n = int(torch.randint(r // 2, r + 1, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(2, vocab, (n,), generator=gen).tolist())
            uids.append(f"g{k}")
    b, rmax = len(prompts), max(map(len, responses))
    mask = torch.arange(rmax)[None] < torch.tensor([len(x) for x in responses])[:, None]
    old = (-2.0 - torch.rand(b, rmax, generator=gen)) * mask
    adv = torch.randn(b, 1, generator=gen).expand(-1, rmax) * mask
    return verl_batch(prompts, responses, uids, old_log_probs=old, advantages=adv, temperature=1.0,
                      calculate_entropy=False)


def build_engine(model: str, zorro: bool, device: str, budget: int):
    from polynya.adapters.verl.engine import DeepSpeedLMEngine
    from polynya.adapters.verl.settings import DeepSpeedEngineConfig
    from verl.workers.config import FSDPOptimizerConfig

    dtype = "bfloat16" if device == "cuda" else "float32"
    cfg = DeepSpeedEngineConfig(dtype=dtype, zero_stage=2, zorro=zorro, seed=0, use_dynamic_bsz=True,
                                max_token_len_per_gpu=budget)
    spec = SimpleNamespace(path=model, local_path=None, lora_rank=0, enable_gradient_checkpointing=device == "cuda")
    engine = DeepSpeedLMEngine(spec, cfg, FSDPOptimizerConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0))
    engine.initialize()
    return engine


def arm(model: str, zorro: bool, data_fn, device: str, iters: int, budget: int) -> dict:
    from polynya.adapters.verl.settings import DeepSpeedActorConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    engine = build_engine(model, zorro, device, budget)
    loss_fn = partial(ppo_loss, config=DeepSpeedActorConfig(rollout_n=1, ppo_mini_batch_size=1, use_dynamic_bsz=True))
    probe = data_fn()
    tu.assign_non_tensor(probe, compute_loss=False)
    logprobs = no_padding_2_padding(engine.infer_batch(probe)["model_output"]["log_probs"], probe).float().cpu()

    def step():
        data = data_fn()
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(data, loss_fn)
        return sum(out["loss"]), engine.optimizer_step(), len(out["loss"])

    first = step()  # also the warm-up
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    return {"loss": first[0], "grad_norm": first[1], "micro_batches": first[2], "step_s": median(times),
            "peak_gib": peak, "logprobs": logprobs}


def free(device: str) -> None:
    """Drop the finished arm's engine before the next one is built."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=None, help="P/R/G,P/R/G (default 1024/512/8,256/512/8)")
    ap.add_argument("--budget", type=int, default=1 << 16, help="tokens per micro-batch")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    need_verl()
    shapes = SHAPES if args.shapes is None else [tuple(map(int, s.split("/"))) for s in args.shapes.split(",")]
    from polynya.models import model_config

    vocab = model_config(args.model).vocab_size
    rows = []
    for shape in shapes:
        data_fn = partial(make_batch, shape, args.groups, vocab)
        on = arm(args.model, True, data_fn, args.device, args.iters, args.budget)
        free(args.device)
        off = arm(args.model, False, data_fn, args.device, args.iters, args.budget)
        free(args.device)
        diff = float((on["logprobs"] - off["logprobs"]).abs().max())
        rows.append({"shape": "P{}/R{}/G{}".format(*shape), "groups": args.groups,
                     "zorro_s": round(on["step_s"], 4), "naive_s": round(off["step_s"], 4),
                     "speedup": round(off["step_s"] / on["step_s"], 3),
                     "loss_rel_diff": abs(on["loss"] - off["loss"]) / max(abs(off["loss"]), 1e-12),
                     "grad_norm_rel_diff": abs(on["grad_norm"] - off["grad_norm"]) / max(off["grad_norm"], 1e-12),
                     "logprob_max_abs_diff": diff, "micro_batches": [on["micro_batches"], off["micro_batches"]],
                     "peak_gib": [round(on["peak_gib"], 2), round(off["peak_gib"], 2)]})
        print(rows[-1], flush=True)
    results = {"env": environment(), "model": args.model, "device": args.device, "rows": rows}
    print(save(results, args.out, "bench_verl_engine"))
    print(markdown_table(rows, [("shape", "P/R/G"), ("naive_s", "naive s"), ("zorro_s", "ZoRRo s"),
                                ("speedup", "speedup"), ("loss_rel_diff", "loss rel diff"),
                                ("logprob_max_abs_diff", "max |dlogp|")]))
    plot(rows, os.path.join(args.out, "bench_verl_engine.png"))


def plot(rows: list[dict], path: str) -> None:
    paired_bars(path, [r["shape"] for r in rows], [r["naive_s"] for r in rows], "ZoRRo off (packed naive)",
                [r["zorro_s"] for r in rows], "ZoRRo", "forward_backward_batch + optimizer_step (s)",
                title="verl deepspeed engine (polynya) through verl's batch format, bf16 ZeRO-2, 4 groups")


if __name__ == "__main__":
    main()

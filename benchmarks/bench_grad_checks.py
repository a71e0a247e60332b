"""The ZeRO-2 optimizer step in three arms, one engine, interleaved per round (issue 15 goal 4)::

    python benchmarks/bench_grad_checks.py --out $OUT

- ``deepspeed``: DeepSpeed's per-tensor gradient checks, multi-tensor AdamW (the step before
  2026-12-07);
- ``fused``: the multi-tensor checks (``polynya.engines._grad_checks``), multi-tensor AdamW;
- ``fused+adamw``: the multi-tensor checks and AdamW's fused kernel (``OptimConfig.fused``, the
  default on CUDA since 2026-12-07, evening).

The training engine with the recipes' settings (random Qwen3-0.6B shape, bf16, ZeRO-2, gradient
clipping 1.0, checkpointing); each round runs ``forward_backward`` on the same small batch, then
``step`` timed alone (wall, CUDA-synchronised) in each arm. Before timing, one step computes both
checks' answers on the same reduced gradients (overflow flag and global norm, clean and with one
NaN put into a gradient) and asserts they agree, and both AdamW kernels update copies of the
engine's fp32 master partition from the same state (their results compared). Each arm's step is
also profiled once (``common.profile_call``: wall vs GPU-busy, kernels). Writes
``bench_grad_checks.json`` and ``.png``; ``--replot JSON`` redraws the PNG of a saved run.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, paired_bars, profile_call, save
from polynya.config import TrainConfig
from polynya.config.train import OptimConfig
from polynya.engines import TrainingEngine
from polynya.engines._grad_checks import _grad_norm, _has_overflow, fuse_grad_checks
from polynya.types import RolloutBatch

METHODS = ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct")
ARMS = {"deepspeed": (False, False), "fused": (True, False), "fused+adamw": (True, True)}  # (checks, AdamW)
LABELS = ["DeepSpeed's checks,\nmulti-tensor AdamW", "multi-tensor checks,\nmulti-tensor AdamW",
          "multi-tensor checks,\nfused AdamW"]


def set_arm(opt, arm: str) -> None:
    checks, adamw = ARMS[arm]
    for name in METHODS:
        vars(opt).pop(name, None)
    if checks:
        assert fuse_grad_checks(opt)
    set_adamw(opt.optimizer, adamw)


def set_adamw(adamw, fused: bool) -> None:
    """Switch a built ``torch.optim.AdamW`` between its kernels: the fused one keeps the step
    count on the parameters' device, the multi-tensor one on the host."""
    for group in adamw.param_groups:
        group["fused"], group["foreach"] = (True, False) if fused else (False, None)
        for p in group["params"]:
            st = adamw.state.get(p)
            if st and "step" in st:
                st["step"] = st["step"].to(p.device if fused else "cpu")


def adamw_agree(opt) -> dict:
    """Both AdamW kernels update copies of the engine's fp32 master partition from the same
    gradient and moments; returns the largest differences (weights, both moments)."""
    inner = opt.optimizer
    group = inner.param_groups[0]
    p0 = group["params"][0]
    g = torch.randn_like(p0) * 1e-3
    out = []
    for fused in (False, True):
        p = p0.detach().clone().requires_grad_(True)
        p.grad = g.clone()
        o = torch.optim.AdamW([p], lr=1e-3, betas=group["betas"], eps=group["eps"], weight_decay=0.01,
                              fused=fused, foreach=None if fused else True)
        st = inner.state[p0]
        o.step()  # creates the state; then load the engine's moments and step again
        o.state[p]["exp_avg"].copy_(st["exp_avg"])
        o.state[p]["exp_avg_sq"].copy_(st["exp_avg_sq"])
        with torch.no_grad():
            p.copy_(p0)
        o.step()
        out.append((p.detach(), o.state[p]["exp_avg"], o.state[p]["exp_avg_sq"]))
    (pa, ma, va), (pb, mb, vb) = out
    diff = {k: float((a - b).abs().max()) for k, a, b in (("weights", pa, pb), ("exp_avg", ma, mb),
                                                            ("exp_avg_sq", va, vb))}
    diff["elements"] = p0.numel()
    assert diff["weights"] <= 1e-5 and diff["exp_avg"] <= 1e-9 and diff["exp_avg_sq"] <= 1e-9, diff
    return diff


def batch_of(vocab: int, seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, vocab - 100, (256,), generator=g).tolist() for _ in range(4)]
    return RolloutBatch([p for p in prompts for _ in range(4)],
                        [torch.randint(100, vocab - 100, (128,), generator=g).tolist() for _ in range(16)],
                        advantages=torch.randn(16, generator=g))


def agree(engine, batch) -> dict:
    """One step in which both implementations answer on the same gradients (the fused ones are
    returned); then the same with a NaN in the middle gradient (the step is skipped)."""
    opt, cls, seen = engine.engine.optimizer, type(engine.engine.optimizer), {}

    def overflow():
        ours = _has_overflow(opt)
        seen["overflow"] = (bool(ours), bool(cls.has_overflow_partitioned_grads_serial(opt)))
        return ours

    def norm(gradients, params, norm_type=2):
        ours = _grad_norm(opt, gradients, params, norm_type)
        seen["norm"] = (float(ours), float(cls.get_grad_norm_direct(opt, gradients, params, norm_type)))
        return ours

    out = {}
    for case in ("clean", "nan"):
        seen.clear()
        opt.has_overflow_partitioned_grads_serial, opt.get_grad_norm_direct = overflow, norm
        if case == "nan":
            def overflow_nan(inner=overflow):
                grads = [g for i in range(len(opt.bit16_groups)) for g in opt.averaged_gradients[i]]
                grads[len(grads) // 2].view(-1)[12345 % grads[len(grads) // 2].numel()] = float("nan")
                return inner()
            opt.has_overflow_partitioned_grads_serial = overflow_nan
        engine.forward_backward(batch)
        skipped = engine.step()["skipped"]
        out[case] = {**seen, "skipped": skipped}
    set_arm(opt, "fused")
    clean, nan = out["clean"], out["nan"]
    assert clean["overflow"] == (False, False) and clean["skipped"] == 0.0, clean
    assert abs(clean["norm"][0] - clean["norm"][1]) <= 1e-6 * clean["norm"][1], clean
    assert nan["overflow"] == (True, True) and nan["skipped"] == 1.0 and "norm" not in nan, nan
    return out


def plot(res: dict, path: str) -> None:
    arms = [a for a in ARMS if a in res["median_ms"]]  # runs before 2026-12-07 evening: two arms
    paired_bars(path, [LABELS[list(ARMS).index(a)] for a in arms],
                [res["median_ms"][a] for a in arms], "step wall, median (ms)",
                [res["profile"][a]["gpu_busy_ms"] or 0.0 for a in arms], "step GPU busy, profiled (ms)",
                "ms", title=f"ZeRO-2 optimizer step, Qwen3-0.6B shape ({res['grad_tensors']} tensors), "
                            f"{res['gpu'].replace('NVIDIA ', '')}, {res['date']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", help="bf16 runs both checks; fp32 only the norm")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG of a saved run, next to it")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.splitext(args.replot)[0] + ".png")
        return
    cfg = TrainConfig(args.model, dtype=args.dtype, zero_stage=2,
                      lr=1e-6, gradient_checkpointing=True, device=args.device, micro_batch_tokens=8192,
                      optim=OptimConfig(grad_clip=1.0))
    engine = TrainingEngine(cfg)
    opt = engine.engine.optimizer
    batch = batch_of(engine.module.config.vocab_size, 0)
    set_arm(opt, "fused")
    checks = agree(engine, batch)
    checks["adamw"] = adamw_agree(opt)
    tensors = sum(1 for p in engine.module.parameters() if p.requires_grad)
    times = {arm: [] for arm in ARMS}
    for r in range(args.rounds + 1):
        for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
            set_arm(opt, arm)
            engine.forward_backward(batch)
            torch.cuda.synchronize() if args.device == "cuda" else None
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize() if args.device == "cuda" else None
            if r > 0:  # round 0 warms both arms up
                times[arm].append((time.perf_counter() - t0) * 1e3)
    profiles = {}
    for arm in ARMS:
        set_arm(opt, arm)
        engine.forward_backward(batch)
        profiles[arm] = profile_call(engine.step)[1]
    med = {arm: statistics.median(ts) for arm, ts in times.items()}
    res = {**environment(), "model": args.model, "rounds": args.rounds, "checks": checks,
           "grad_tensors": tensors, "step_ms": {k: [round(x, 2) for x in v] for k, v in times.items()},
           "median_ms": {k: round(v, 2) for k, v in med.items()},
           "saved_ms": round(med["deepspeed"] - med["fused"], 2),
           "ratio": round(med["deepspeed"] / med["fused"], 3),
           "adamw_saved_ms": round(med["fused"] - med["fused+adamw"], 2),
           "adamw_ratio": round(med["fused"] / med["fused+adamw"], 3), "profile": profiles}
    print({k: res[k] for k in ("gpu", "median_ms", "saved_ms", "ratio", "adamw_saved_ms", "adamw_ratio",
                               "grad_tensors")})
    print({arm: {k: p[k] for k in ("wall_ms", "gpu_busy_ms", "kernels")} for arm, p in profiles.items()})
    print("checks", checks)
    print(save(res, args.out, "bench_grad_checks"))
    plot(res, os.path.join(args.out, "bench_grad_checks.png"))


if __name__ == "__main__":
    main()

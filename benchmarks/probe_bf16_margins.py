"""How close the bf16 rule of ``tests/core/test_model_families_gpu.py`` runs to its limit.

The test asserts, per parameter, ``err_z <= 2 * err_low + 1e-3``: the relative gradient error
of a bf16 ZoRRo / packed-naive run against an fp32 eager reference is no more than twice the
bf16 eager padded run's. One case (gemma3, packed naive) failed once on an H100 and passed on
the re-run. This probe runs every family x path ``--repeats`` times and prints, per case, the
largest *load* ``err_z / (2 * err_low + 1e-3)`` over parameters (the test fails above 1), the
parameter that carries it, and how much two identical bf16 runs differ from each other (the
backward's own nondeterminism, relative to err_low)::

    python benchmarks/probe_bf16_margins.py --repeats 4 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import polynya.logprobs  # noqa: E402
from tests.core.test_model_families import ZORRO_FAMILIES  # noqa: E402
from tests.core.test_model_families_gpu import _load, _run, long_batch  # noqa: E402

KW = {"split": dict(zorro=True, zorro_attention="split"),
      "flex": dict(zorro=True, zorro_attention="flex"),
      "packed naive": dict(zorro=False, naive_layout="packed")}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def case(family: str, attention: str, repeats: int) -> dict:
    ref, low_naive, low = (_load(family, "float32", "eager"), _load(family, "bfloat16", "eager"),
                           _load(family, "bfloat16"))
    batch = long_batch(2, ref.config.vocab_size)
    _, gr = _run(ref, batch, zorro=False, naive_layout="padded")
    _, gn = _run(low_naive, batch, zorro=False, naive_layout="padded")
    loads, worst, self_noise = [], None, []
    prev = None
    for _ in range(repeats):
        _, gz = _run(low, batch, **KW[attention])
        best = max(((rel(gz[k], g) / (2 * rel(gn[k], g) + 1e-3), k) for k, g in gr.items()))
        loads.append(best[0])
        if worst is None or best[0] > worst[0]:
            worst = (best[0], best[1], rel(gz[best[1]], gr[best[1]]), rel(gn[best[1]], gr[best[1]]))
        if prev is not None:  # two identical runs: the backward's own spread
            self_noise.append(max(rel(gz[k], prev[k]) / max(rel(gn[k], gr[k]), 1e-12)
                                  for k in gr))
        prev = gz
    return {"family": family, "attention": attention, "loads": loads, "worst_param": worst[1],
            "err_z": worst[2], "err_low": worst[3],
            "run_to_run_over_err_low": max(self_noise) if self_noise else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--families", default=",".join(ZORRO_FAMILIES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    polynya.logprobs.ZORRO_MIN_WORK = 0  # as the test's fixture: ZoRRo on small batches
    rows = []
    for family in args.families.split(","):
        for attention in KW:
            r = case(family, attention, args.repeats)
            rows.append(r)
            print(f"{family:13s} {attention:12s} max load {max(r['loads']):.3f} "
                  f"(runs {' '.join(f'{x:.3f}' for x in r['loads'])}) at {r['worst_param']} "
                  f"err_z {r['err_z']:.4f} err_low {r['err_low']:.4f} run-to-run/err_low "
                  f"{r['run_to_run_over_err_low']:.3f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_bf16_margins.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

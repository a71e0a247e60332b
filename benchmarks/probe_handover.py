"""The colocated hand-over's trainer offload with and without DeepSpeed's full garbage-collection
passes (``polynya.engines._deepspeed._young_gc_only``): time and device memory freed, same engine.

    python benchmarks/probe_handover.py --out benchmarks/results

A ZeRO-2 bf16 ``TrainingEngine`` (random Qwen3-0.6B shape) takes one GRPO step, then
``offload()`` / ``onload()`` run ``--cycles`` times in each mode, alternating; each offload reports
its wall time (device synchronised) and ``freed_fraction`` (of the device memory allocated before
it; only this engine is on the device). The process holds a tokenizer-sized heap of Python
objects (``--heap``) so that a full collection costs what it costs in a recipe process.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import polynya
import torch
from polynya.config import TrainConfig
from polynya.engines import TrainingEngine, _deepspeed


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--heap", type=int, default=2_000_000, help="extra tracked Python objects")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    heap = [[i] for i in range(args.heap)]  # noqa: F841 - GC-tracked objects a full pass walks
    engine = TrainingEngine(TrainConfig(args.model, dtype="bfloat16", zero_stage=2, gradient_checkpointing=True))
    g = torch.Generator().manual_seed(0)
    vocab = engine.module.config.vocab_size
    prompts = [torch.randint(100, vocab, (200,), generator=g).tolist() for _ in range(4) for _ in range(4)]
    responses = [torch.randint(100, vocab, (64,), generator=g).tolist() for _ in range(16)]
    batch = polynya.RolloutBatch(prompts, responses, advantages=torch.randn(16))
    engine.forward_backward(batch)
    engine.step()
    original = _deepspeed._young_gc_only
    rows = {"young_gc_only": [], "full_gc": []}
    for _ in range(args.cycles):
        for mode in rows:
            _deepspeed._young_gc_only = original if mode == "young_gc_only" else contextlib.nullcontext
            _sync()
            t = time.perf_counter()
            info = engine.offload()
            _sync()
            rows[mode].append({"offload_s": time.perf_counter() - t, **info})
            engine.onload()
    _deepspeed._young_gc_only = original
    summary = {m: {"offload_ms": round(1e3 * statistics.median(r["offload_s"] for r in v), 1),
                   "freed_fraction": [round(r["freed_fraction"], 4) for r in v],
                   "before_gb": round(v[0]["before"] / 2**30, 2)} for m, v in rows.items()}
    print(json.dumps(summary, indent=1), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_handover.json"), "w") as f:
        json.dump({"summary": summary, "runs": rows, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}, f, indent=1)


if __name__ == "__main__":
    main()

"""Log-prob engine arm of ``bench_sync.py``: a weight sync's receive into a ZeRO-0 log-prob
engine (what the local client's colocated sync does after the sampler's), old vs new path side
by side in one process.

The trainer's span buckets (its flat bf16 storage, as ``LocalClient.sync_weights`` stages
them) go into a bf16 ZeRO-0 ``LogProbEngine``:

- ``tensor_by_tensor``: ``polynya.engines._deepspeed.load_pieces`` — the engine's path before
  it took the sampler's: ``checked_pairs`` (one read for digest + finite values), then one
  ``copy_`` per tensor through DeepSpeed's gather context (310 tensors);
- ``verified``: ``LogProbEngine.load_weights`` — ``polynya.verified_copy``'s plan kept per
  layout (one check pass, one copy launch per bucket).

Each arm runs ``iters`` times after one warm-up, alternating (ABAB); wall clock with the device
synchronised around each load; after every load the engine's checksum must equal the
trainer's.
"""
from __future__ import annotations

import time
import traceback

import torch
from common import median


def bench_logprob_receive(trainer, model: str, iters: int, device: str) -> dict:
    from polynya.config.logprob import LogProbConfig
    from polynya.engines import _deepspeed as dsu
    from polynya.engines.logprob import LogProbEngine
    from polynya.sync import StagedUpdate, build_manifest
    from polynya.sync.manifest import flat_spans

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    try:
        engine = LogProbEngine(LogProbConfig(model, dtype="bfloat16", zero_stage=0, device=device))
        spans = flat_spans(trainer.module)
        if spans is None:
            return {"error": "the trainer's weights are not spans of flat storages"}
        m = build_manifest(trainer, version=1, bucket_bytes=1 << 28, layout="spans")
        staged = StagedUpdate(m)
        for i, (span, _) in enumerate(spans):
            staged.put(i, span)
        want = trainer.weight_checksum()
        arms = {
            "tensor_by_tensor": lambda v: dsu.load_pieces(engine.module, staged.pieces(),
                                                         checksum=m.checksum),
            "verified": lambda v: engine.load_weights(staged.pieces(), version=v,
                                                      checksum=m.checksum),
        }
        times: dict[str, list[float]] = {k: [] for k in arms}
        version = 0
        for it in range(iters + 1):
            for name, load in arms.items():
                version += 1
                sync()
                t0 = time.perf_counter()
                load(version)
                sync()
                if it:  # the first round warms up (plans, Triton compiles)
                    times[name].append((time.perf_counter() - t0) * 1e3)
                if engine.weight_checksum() != want:
                    return {"error": f"{name}: the engine's checksum differs from the trainer's"}
        rows = {k: median(v) for k, v in times.items()}
        out = {"bytes": m.nbytes, "tensors": sum(len(b.names) for b in m.buckets),
               "ms": rows, "speedup": rows["tensor_by_tensor"] / rows["verified"],
               "checksums_match": True, "plan_kept": bool(engine._copy_plans)}  # noqa: SLF001
        del engine
        return out
    except Exception:  # noqa: BLE001 (keep the bench's other arms)
        return {"error": traceback.format_exc()}

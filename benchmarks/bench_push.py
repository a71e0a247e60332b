"""In-process weight push (the TRL adapter's ``push_weights``) and the checksums under it: the
previous code vs ``polynya.sync.push.WeightPush`` / the O(1)-launch digests, side by side.

A random policy of the model's shape is pushed into a native sampler in the same process.
Rows (median wall ms of ``--iters`` runs, the device synchronised around each; GB/s of the
weights' bytes in the sampler's dtype; ``vs_hbm`` = an HBM copy of those bytes / the row's ms,
so 1.0 would be one copy's time; aten ops of one run, counted by a ``TorchDispatchMode``):

- ``checksum_views``: the policy's parameters (one storage each). *old*: one ``DigestPlan``
  per storage (2 launches + tables each); *new*: one ``ScatterPlan`` launch + the sums.
- ``check_pairs``: what the sampler's ``load_weights`` checks before it copies (finite values +
  the checksum). *old*: an ``aminmax`` per storage, then the old digest; *new*: one read.
- ``sampler.weight_checksum``: the sampler's ~310 parameters, old vs new digest.
- ``push bf16 -> bf16``: the whole push. *old*: ``push_weights`` before this change (pairs cast
  with ``.to``, old checksum, old checks, old post-load checksum); *new*: ``WeightPush``
  (direct: no staging memory).
- ``push fp32 -> bf16``: a cast is needed. *new*: ``WeightPush`` through its staging buffer.
- ``push bf16 -> bf16, staged``: ``WeightPush`` forced through the staging buffer (a no-op
  gather, as under ZeRO-3, chunks of 256 MiB).

The *old* rows run the previous implementation: ``old_checksum_views`` below is the former
``polynya.checksum.checksum_views`` verbatim, and the old checks are the current ``non_finite``
torch path (its former self) with that digest.

    python benchmarks/bench_push.py --out $OUT                     # H200: random Qwen3-0.6B bf16
    python benchmarks/bench_push.py --model tiny:qwen3 --iters 3   # CPU smoke (torch paths)

The push inside a whole TRL step is the ``push`` phase of ``profile_trl_step.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from common import (cuda_median_ms, environment, markdown_table, median, paired_bars, save,
                    wall_median_ms)
from op_count import OpCount


def old_checksum_views(items) -> str:
    """``polynya.checksum.checksum_views`` before the ScatterPlan (one DigestPlan per storage)."""
    from polynya.checksum import (
        cached_plan,
        checksum_lines,
        checksum_named_tensors,
        gather,
        signature_prefix,
    )
    from polynya.kernels.digest.op import MAX_TENSOR, have_triton

    items = list(items)
    if not items or not have_triton() or not all(
        t.is_cuda and t.is_contiguous() and t.numel() < MAX_TENSOR for _, t in items
    ):
        return checksum_named_tensors(items)
    groups: dict = {}
    for name, t in items:
        groups.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append((name, t))
    prefixes, digests = [], []
    for members in groups.values():
        first = members[0][1]
        size = first.untyped_storage().nbytes() // first.element_size()
        flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), 0, (size,))
        plan = cached_plan([t.storage_offset() for _, t in members], [t.numel() for _, t in members])
        digests.append(plan.digest_tensor([flat], kernel=True))
        prefixes += [signature_prefix(n, t.dtype, t.shape) for n, t in members]
    return checksum_lines(prefixes, gather(digests))


@contextlib.contextmanager
def old_paths():
    """The checks and digests as they were: ``check_pairs`` = ``non_finite`` (aminmax per
    storage) then ``old_checksum_views``; the sampler's ``weight_checksum`` = the old digest."""
    import polynya.engines.sample.native.model_runner as mr
    import polynya.weights as w

    def scan(items, *, finite=True):
        items = list(items)
        return old_checksum_views(items), (w.non_finite(items) if finite else [])

    with mock.patch.object(w, "scan_views", scan), \
            mock.patch.object(w, "non_finite_views", lambda items: None), \
            mock.patch.object(mr, "checksum_views", old_checksum_views):
        yield


def old_push(sampler, policy, dtype: torch.dtype) -> None:
    """``GRPOTrainer.push_weights`` before this change (no ZeRO-3), under ``old_paths``."""
    want = [(n, t.data.to(dtype)) for n, t in policy.named_parameters()]
    expected = old_checksum_views(want)
    sampler.load_weights(want, checksum=expected)
    assert sampler.weight_checksum() == expected


def hbm_copy_ms(nbytes: int, device: str) -> float:
    """One device-to-device copy of ``nbytes`` (CUDA events; wall clock on CPU)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    if device == "cuda":
        return median(cuda_median_ms(lambda: dst.copy_(src), warmup=3, iters=20))
    return wall_median_ms(lambda: dst.copy_(src), warmup=3, iters=20)


def ops_of(fn) -> int:
    with OpCount() as c:
        fn()
    return c.ops


def row(name: str, arm: str, fn, nbytes: int, hbm_ms: float, iters: int) -> dict:
    ms = wall_median_ms(fn, warmup=2, iters=iters)
    return {"row": name, "arm": arm, "ms": round(ms, 3), "GBps": round(nbytes / ms / 1e6, 1),
            "vs_hbm": round(hbm_ms / ms, 3), "aten_ops": ops_of(fn)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="bench_push_"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of an earlier run's JSON")
    args = ap.parse_args()
    if args.replot:
        plot(args.replot)
        return
    from polynya.checksum import checksum_views
    from polynya.config import SamplerConfig
    from polynya.engines import SamplingEngine
    from polynya.models import load_model
    from polynya.sync import WeightPush
    from polynya.weights import check_pairs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = torch.bfloat16
    sampler = SamplingEngine(SamplerConfig(args.model, dtype="bfloat16", device=device,
                                           num_blocks=64, seed=0))
    policy = load_model(args.model, dtype="bfloat16", device=device, seed=1)
    policy32 = load_model(args.model, dtype="float32", device=device, seed=2)
    pairs = list(policy.named_parameters())
    nbytes = sum(p.numel() * 2 for _, p in pairs)
    hbm_ms = hbm_copy_ms(nbytes, device)
    want = checksum_views(pairs)
    push, staged = WeightPush(), WeightPush()
    no_gather = lambda ps: contextlib.nullcontext()

    cases = [
        ("checksum_views", lambda: old_checksum_views(pairs), lambda: checksum_views(pairs)),
        ("check_pairs", lambda: check_pairs(pairs, checksum=want),
         lambda: check_pairs(pairs, checksum=want)),
        ("sampler.weight_checksum", sampler.weight_checksum, sampler.weight_checksum),
        ("push bf16 -> bf16", lambda: old_push(sampler, policy, bf16),
         lambda: push(sampler, policy.named_parameters())),
        ("push fp32 -> bf16", lambda: old_push(sampler, policy32, bf16),
         lambda: push(sampler, policy32.named_parameters())),
        ("push bf16 -> bf16, staged", None,
         lambda: staged(sampler, policy.named_parameters(), gather=no_gather)),
    ]
    rows = []
    for name, old, new in cases:
        if old is not None:
            with old_paths():
                rows.append(row(name, "old", old, nbytes, hbm_ms, args.iters))
        rows.append(row(name, "new", new, nbytes, hbm_ms, args.iters))
        print(rows[-2] if old is not None else "", rows[-1], flush=True)
    assert sampler.weight_checksum() == checksum_views(pairs)  # the last push: policy's weights
    ms = {(r["row"], r["arm"]): r["ms"] for r in rows}
    speedups = {name: round(ms[name, "old"] / ms[name, "new"], 1)
                for name, old, _ in cases if old is not None}
    table = markdown_table(rows, [("row", "what"), ("arm", "arm"), ("ms", "median ms"),
                                  ("GBps", "GB/s"), ("vs_hbm", "HBM copy / this"),
                                  ("aten_ops", "aten ops")])
    print(f"\n{args.model}: {len(pairs)} tensors, {nbytes / 1e9:.3f} GB in bf16; "
          f"HBM copy {hbm_ms:.3f} ms\n{table}\nold / new: {speedups}")
    path = save({"env": environment(), "model": args.model, "tensors": len(pairs), "bytes": nbytes,
                 "hbm_copy_ms": hbm_ms, "rows": rows, "speedup_old_over_new": speedups},
                args.out, "bench_push")
    print(f"JSON: {path}")
    plot(path)


def plot(json_path: str) -> None:
    """``bench_push.png`` next to the JSON: old vs new median ms per row (log scale)."""
    with open(json_path) as f:
        results = json.load(f)
    ms = {(r["row"], r["arm"]): r["ms"] for r in results["rows"]}
    names = [n for n in dict.fromkeys(r["row"] for r in results["rows"]) if (n, "old") in ms]
    paired_bars(os.path.join(os.path.dirname(json_path), "bench_push.png"),
                [n.replace("push ", "push\n").replace(".", "\n") for n in names], [ms[n, "new"] for n in names],
                "new (one read / O(1) launches)", [ms[n, "old"] for n in names],
                "old (per tensor)", "median wall ms (log)",
                title=f"Weight push + checks, {results['model']} ({results['bytes'] / 1e9:.2f} GB, "
                      f"{results['tensors']} tensors), {results['env'].get('gpu', '')}", log=True)


if __name__ == "__main__":
    main()

"""Receive-path arm of ``bench_sync.py``: old vs new verify + apply, side by side in one process.

The sampler's parameters of a model shape (default the random Qwen3-0.6B, bf16, tied
embeddings as the real one) receive the same bytes from flat buckets the way a sync delivers
them: *spans* (one flat storage holding every tensor, as a ZeRO-2 trainer shares it over
CUDA-IPC) and *packed* (``export_weights`` buckets of 256 MiB, as NCCL receives them). Arms,
each timed wall clock with the device synchronised (median of ``iters`` after warm-up):

- ``old``: the path before the fused kernel — ``checked_pairs`` (finite ``aminmax`` pass,
  Triton digest, one host transfer each) then one ``_foreach_copy_``;
- ``new``: ``VerifiedBucketCopy.load`` — one check pass (digest + finite count in one read),
  one host transfer and compare, one copy launch per bucket;
- ``check`` / ``copy``: the new path's two passes alone; ``copy_digest``: one fused pass
  (copy + digest + finite count) into a staging buffer (what a double-buffered receiver
  would pay); ``trainer_digest``: the sender's digest of the same bytes (``DigestPlan``);
  ``check_8warps`` / ``copy_8warps``: the two passes with 8 warps per program (default 4);
- ``hbm_copy``: ``dst.copy_(src)`` of the same bytes (the reference bandwidth).

No DeepSpeed, no second process: ``python benchmarks/bench_sync.py --receive-only``.
"""
from __future__ import annotations

import traceback

import torch
from common import wall_median_ms



def _hbm_copy_ms(nbytes: int, device: str) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return wall_median_ms(lambda: dst.copy_(src), warmup=3, iters=20)


def _buckets(params: dict[str, torch.Tensor], kind: str, device: str):
    """(specs, flats) holding a perturbed copy of ``params`` laid out as a sync delivers it."""
    from polynya.sync.manifest import plan_buckets
    from polynya.weights import BucketSpec

    named = list(params.items())
    if kind == "packed":
        specs = plan_buckets([(n, tuple(p.shape)) for n, p in named], 2, 1 << 28)
    else:  # one span, tensors 128-element aligned like DeepSpeed's flat buffer
        offsets, pos = [], 0
        for _, p in named:
            offsets.append(pos)
            pos += -(-p.numel() // 128) * 128
        specs = (BucketSpec(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named),
                            tuple(offsets), pos),)
    flats = []
    for spec in specs:
        flat = torch.zeros(spec.numel, dtype=named[0][1].dtype, device=device)
        for (_, view), name in zip(spec.views(flat), spec.names):
            view.copy_(params[name] * 1.001 + 1e-4)  # a different version of the weights
        flats.append(flat)
    return specs, flats


def bench_receive(model: str, iters: int, device: str = "cuda") -> dict:
    """Every arm for the spans and packed layouts (module docstring); a dict for the JSON."""
    from polynya.models import load_model

    torch.manual_seed(0)
    module = load_model(model, dtype="bfloat16", device=device).requires_grad_(False)
    params = dict(module.named_parameters())  # the names a trainer's manifest carries
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    out: dict = {"model": model, "bytes": nbytes, "tensors": len(params)}
    out["hbm_copy_ms"] = _hbm_copy_ms(nbytes, device)
    hbm_gbps = nbytes / out["hbm_copy_ms"] / 1e6
    out["hbm_copy_GBps"] = hbm_gbps
    for kind in ("spans", "packed"):
        try:
            out[kind] = _bench_layout(params, kind, iters, hbm_gbps)
        except Exception:  # noqa: BLE001 (keep the other layout and the rest of bench_sync)
            out[kind] = {"error": traceback.format_exc()}
        print(kind, out[kind], flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _bench_layout(params: dict[str, torch.Tensor], kind: str, iters: int, hbm_gbps: float
                  ) -> dict:
    """Every arm for one layout of the buckets (module docstring)."""
    from polynya.checksum import checksum_views
    from polynya.kernels.digest import DigestPlan
    from polynya.kernels.digest.copy import CopyPlan
    from polynya.verified_copy import VerifiedBucketCopy
    from polynya.weights import BucketCopyPlan, FlatBuckets, checked_pairs

    device = next(iter(params.values())).device
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    specs, flats = _buckets(params, kind, device)
    fb = FlatBuckets(specs, flats)
    checksum = checksum_views([pair for s, f in zip(specs, flats) for pair in s.views(f)])
    shapes = {n: p.shape for n, p in params.items()}
    old_plan = BucketCopyPlan(specs, params)
    new = VerifiedBucketCopy(specs, params, flats[0].dtype)
    staging = [torch.empty_like(f) for f in flats]
    fused = CopyPlan([(s.starts(), s.sizes(), [st[o:o + n] for o, n in zip(s.starts(), s.sizes())])
                      for s, st in zip(specs, staging)])
    digest = DigestPlan([(s.starts(), s.sizes()) for s in specs])
    wide = CopyPlan([(s.starts(), s.sizes(), [params[n].detach().view(-1) for n in s.names])
                     for s in specs], num_warps=8)  # the new path's passes at 8 warps

    def old():
        checked_pairs(fb, shapes, checksum=checksum)
        with torch.no_grad():
            torch._foreach_copy_(old_plan.dst, old_plan.sources(flats))

    arms = {
        "old": old,
        "new": lambda: new.load(flats, checksum),
        "check": lambda: new.plan.check(flats),
        "copy": lambda: new.plan.copy(flats),
        "copy_digest": lambda: fused.copy(flats, digest=True),
        "trainer_digest": lambda: digest.digest_tensor(flats),
        "check_8warps": lambda: wide.check(flats),
        "copy_8warps": lambda: wide.copy(flats),
    }
    row: dict = {"buckets": len(specs)}
    runs: dict[str, list[float]] = {"old": [], "new": []}
    for name in ("old", "new", "old", "new"):  # interleaved: drift hits both alike
        runs[name].append(wall_median_ms(arms[name], warmup=2, iters=iters))
    for name in ("old", "new"):
        row[name + "_ms"] = min(runs[name])
    for name in ("check", "copy", "copy_digest", "trainer_digest", "check_8warps", "copy_8warps"):
        row[name + "_ms"] = wall_median_ms(arms[name], warmup=2, iters=iters)
    for name in arms:
        row[name + "_GBps"] = nbytes / row[name + "_ms"] / 1e6
        row[name + "_vs_hbm"] = row[name + "_GBps"] / hbm_gbps
    new.load(flats, checksum)
    row["applied_bytes_equal"] = all(torch.equal(params[n].view(-1), v.reshape(-1))
                                     for s, f in zip(specs, flats) for n, v in s.views(f))
    bad = [f.clone() for f in flats]
    bad[-1][-1] = bad[-1][-1] + 1
    last = params[specs[-1].names[-1]]
    before = last.clone()
    try:
        new.load(bad, checksum)
        row["corruption_refused"] = False
    except ValueError:
        row["corruption_refused"] = torch.equal(last, before)
    return row


def receive_table(res: dict) -> list[dict]:
    """Rows for ``common.markdown_table``: one per layout and arm."""
    rows = []
    for kind in ("spans", "packed"):
        row = res.get(kind) or {}
        for arm in ("old", "new", "check", "copy", "copy_digest", "trainer_digest",
                    "check_8warps", "copy_8warps"):
            if arm + "_ms" in row:
                rows.append({"layout": f"{kind} ({row['buckets']} buckets)", "arm": arm,
                             "ms": f"{row[arm + '_ms']:.3f}", "GBps": f"{row[arm + '_GBps']:.0f}",
                             "vs": f"{row[arm + '_vs_hbm']:.0%}"})
    return rows

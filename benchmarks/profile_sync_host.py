"""Host (Python) time of a span weight sync, without a GPU: where the CPU time goes.

A sync's device work (digest, check and copy kernels) is timed by ``bench_sync.py`` on the GPU;
this probe times everything around it on any machine: the trainer's ``build_manifest`` (span
layout check, checksum lines), ``export_spans``, the manifest's pickling round trip (what the
pipe carries) and the receiver's ``apply_update`` (layout lookup, plan lookup, verify's
host part). Model: the 310 parameters of the random Qwen3-0.6B layout with a tiny hidden size
(same names and count, small tensors), the trainer's weights views of one flat storage as
under ZeRO-2, a native sampler on CPU.

**Inside this script only** the digest / check / copy kernels are replaced by stubs that
return zeros (both sides agree, so the sync is accepted): the numbers are host time, not a
sync's time, and no checksum here means anything. Never use it to judge correctness.

    python benchmarks/profile_sync_host.py [--iters 40] [--cprofile]
"""
from __future__ import annotations

import argparse
import cProfile
import pickle
import pstats
import time

import torch

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def _stub_kernels() -> None:
    """Digest, check and copy return zeros / nothing (this script only: host time)."""
    from polynya.kernels.digest import copy as cp
    from polynya.kernels.digest import op

    def digest(self, flats, *, kernel=None):
        return torch.zeros(self.num_tensors, dtype=torch.int64)

    def check(self, flats, *, kernel=None):
        return (torch.zeros(self.num_tensors, dtype=torch.int64),
                torch.zeros(self.num_tensors, dtype=torch.int64))

    def copy(self, flats, *, digest=False, kernel=None):
        return None

    op.DigestPlan.digest_tensor = digest
    cp.CopyPlan.check = check
    cp.CopyPlan.copy = copy


def _tiny_qwen3() -> None:
    """``random:qwen3-0.6b`` with a tiny hidden size (this process only): same 310 names."""
    import polynya.models as models

    models._RANDOM["qwen3-0.6b"] = dict(models._RANDOM["qwen3-0.6b"], **TINY)  # noqa: SLF001


class FlatTrainer:
    """The trainer side: a module whose weights are views of one flat storage (ZeRO-2)."""

    def __init__(self):
        from polynya.models import load_model

        self.module = load_model("random:qwen3-0.6b", dtype="bfloat16").requires_grad_(False)
        named = list(self.module.named_parameters())
        flat = torch.zeros(sum(-(-p.numel() // 128) * 128 for _, p in named),
                           dtype=torch.bfloat16)
        pos = 0
        for _, p in named:
            n = p.numel()
            flat[pos:pos + n].copy_(p.reshape(-1))
            p.data = flat[pos:pos + n].view(p.shape)
            pos += -(-n // 128) * 128

    def weight_checksum(self, bucket_bytes: int = 1 << 28) -> str:
        from polynya.engines._deepspeed import weights_checksum

        return weights_checksum(self.module, bucket_bytes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--cprofile", action="store_true", help="also print cProfile's top 25")
    a = ap.parse_args()
    _stub_kernels()
    _tiny_qwen3()
    from polynya.config import SamplerConfig
    from polynya.engines import SamplingEngine
    from polynya.spans import export_spans
    from polynya.sync import StagedUpdate, apply_update, build_manifest

    trainer = FlatTrainer()
    sampler = SamplingEngine(SamplerConfig("random:qwen3-0.6b", dtype="bfloat16", device="cpu",
                                           num_blocks=16, cuda_graphs=False))
    phases: dict[str, list[float]] = {}

    def one(version: int) -> None:
        t = [time.perf_counter()]
        m = build_manifest(trainer, version=version, bucket_bytes=1 << 28, layout="spans",
                           ready=False)
        t.append(time.perf_counter())
        spans = export_spans(trainer.module, m.buckets)
        t.append(time.perf_counter())
        received = pickle.loads(pickle.dumps(m))
        t.append(time.perf_counter())
        staged = StagedUpdate(received)
        for i, flat in enumerate(spans):
            staged.put(i, flat)
        assert apply_update(sampler, staged) == version
        t.append(time.perf_counter())
        for name, t0, t1 in zip(("build_manifest", "export_spans", "manifest pickle round trip",
                                 "stage + apply_update"), t, t[1:]):
            phases.setdefault(name, []).append((t1 - t0) * 1e6)
        phases.setdefault("total", []).append((t[-1] - t[0]) * 1e6)

    one(1)
    phases.clear()
    for v in range(2, a.iters + 2):
        one(v)
    print(f"{len(list(trainer.module.parameters()))} parameters, {a.iters} syncs (host us)")
    for name, vals in phases.items():
        vals.sort()
        print(f"  {name:28s} min {vals[0]:8.1f}  median {vals[len(vals) // 2]:8.1f}")
    if a.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for v in range(a.iters + 2, 2 * a.iters + 2):
            one(v)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

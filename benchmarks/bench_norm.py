"""The fused RMSNorm (``polynya.kernels.norm``) against HF's ``Qwen3RMSNorm`` module, per call.

Shapes are the norms of a Qwen3 training micro-batch (``--tokens``, default 8 samples x 384 =
3072): the hidden-state norm ``[tokens, 1024]``, ``q_norm`` ``[tokens, 16, 128]``, ``k_norm``
``[tokens, 8, 128]``, plus wider rows (Qwen3-4B's 2560, 8192) and a 16k-token batch. For each,
bf16, forward and forward + backward (``torch.autograd.grad`` of both input and weight):

- ``*_ms``: device time per call (``triton.testing.do_bench``: CUDA events, median);
- ``*_loop_us``: wall time per call in a back-to-back loop of ``--loop`` calls, one sync at the
  end — what a host-bound training step sees (launch + Python + dispatch cost included);
- ``*_kernels``: CUDA kernels launched per call (``torch.profiler``);
- ``fused_*_gbps``: the fused kernels' useful bytes (forward: read x, write y; backward: read dy
  and x, write dx) per device second (``fused_bwd_ms``: the two backward launches alone).

    python benchmarks/bench_norm.py --out $OUT                          # H200, ~1 min
    TRITON_INTERPRET=1 python benchmarks/bench_norm.py --smoke          # CPU: the script runs

Results: ``<--out>/bench_norm.json`` and ``.png`` (forward + backward loop us per shape).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, paired_bars, save  # noqa: E402

import torch  # noqa: E402

from polynya.kernels.norm import op, rms_norm  # noqa: E402

EPS = 1e-6


def shapes(tokens: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("hidden 1024", (tokens, 1024)), ("q_norm 16x128", (tokens, 16, 128)),
            ("k_norm 8x128", (tokens, 8, 128)), ("hidden 2560", (tokens, 2560)),
            ("hidden 8192", (tokens, 8192)), ("16k tokens x 1024", (16384, 1024))]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def loop_us(fn, device: str, n: int) -> float:
    fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t) * 1e6 / n


def kernels_per_call(fn, device: str) -> int | None:
    if device != "cuda":
        return None
    fn()
    _sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(name: str, shape: tuple[int, ...], device: str, loop: int) -> dict:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    h = shape[-1]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
    module = Qwen3RMSNorm(h, eps=EPS).to(device=device, dtype=torch.bfloat16)
    w = module.weight
    arms = {"hf": lambda t: module(t), "fused": lambda t: rms_norm(t, w, EPS)}
    row = {"shape": name, "dims": "x".join(map(str, shape))}
    for arm, f in arms.items():
        def fwd(f=f):
            with torch.no_grad():
                f(x)

        def fwd_bwd(f=f):
            torch.autograd.grad(f(x), (x, w), dy)

        for kind, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            row[f"{arm}_{kind}_ms"] = round(device_ms(fn, device), 4)
            row[f"{arm}_{kind}_loop_us"] = round(loop_us(fn, device, loop), 1)
            row[f"{arm}_{kind}_kernels"] = kernels_per_call(fn, device)
    elems, e = x.numel(), x.element_size()
    row["fused_fwd_gbps"] = round(2 * elems * e / (row["fused_fwd_ms"] * 1e-3) / 1e9, 1)
    with torch.no_grad():
        _, rstd, x2 = op.rms_norm_forward(x, w, EPS)
    row["fused_bwd_ms"] = round(device_ms(lambda: op.rms_norm_backward(dy, x2, w, rstd, True),
                                          device), 4)  # the two backward launches alone
    row["fused_bwd_gbps"] = round(3 * elems * e / (row["fused_bwd_ms"] * 1e-3) / 1e9, 1)
    for kind in ("fwd", "fwd_bwd"):
        row[f"{kind}_speedup"] = round(row[f"hf_{kind}_ms"] / row[f"fused_{kind}_ms"], 2)
        hf_us, fused_us = row[f"hf_{kind}_loop_us"], row[f"fused_{kind}_loop_us"]
        row[f"{kind}_loop_speedup"] = round(hf_us / fused_us, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8 * 384)
    ap.add_argument("--loop", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (Triton interpreter)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        op.KERNEL_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
        todo, args.loop = [("smoke", (5, 3, 40)), ("smoke heads", (5, 4, 16))], 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_norm.py needs a CUDA GPU (or --smoke on CPU)")
        todo = shapes(args.tokens)
    rows = []
    for name, shape in todo:
        rows.append(measure(name, shape, device, args.loop))
        print(rows[-1], flush=True)
    path = save(dict(environment(), tokens=args.tokens, loop=args.loop, dtype="bfloat16",
                     rows=rows), args.out, "bench_norm")
    paired_bars(path.replace(".json", ".png"), [r["shape"] for r in rows],
                [r["hf_fwd_bwd_loop_us"] for r in rows], "HF Qwen3RMSNorm",
                [r["fused_fwd_bwd_loop_us"] for r in rows], "polynya fused",
                "fwd+bwd us per call (back-to-back loop)",
                title="RMSNorm forward + backward, bf16, per call")
    print(markdown_table(rows, [
        ("shape", "shape"), ("dims", "dims"), ("hf_fwd_ms", "HF fwd ms"),
        ("fused_fwd_ms", "fused fwd ms"), ("fused_fwd_gbps", "fused fwd GB/s"),
        ("hf_fwd_bwd_ms", "HF fwd+bwd ms"), ("fused_fwd_bwd_ms", "fused fwd+bwd ms"),
        ("fused_bwd_ms", "fused bwd ms"), ("fused_bwd_gbps", "fused bwd GB/s"),
        ("hf_fwd_bwd_kernels", "HF kernels"),
        ("fused_fwd_bwd_kernels", "fused kernels"), ("hf_fwd_bwd_loop_us", "HF loop us"),
        ("fused_fwd_bwd_loop_us", "fused loop us"), ("fwd_bwd_loop_speedup", "loop speed-up")]))


if __name__ == "__main__":
    main()

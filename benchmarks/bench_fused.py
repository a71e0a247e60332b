"""polynya's fused training kernels against HF's code, per call: ``rms_norm`` vs the
``Qwen3RMSNorm`` module and ``rope`` vs ``apply_rotary_pos_emb``.

Shapes are those of a Qwen3 training micro-batch (``--tokens``, default 8 samples x 384 = 3072):
norms of the hidden state ``[tokens, 1024]``, ``q_norm`` ``[tokens, 16, 128]``, ``k_norm``
``[tokens, 8, 128]``, wider rows (Qwen3-4B's 2560, 8192) and a 16k-token batch; RoPE of Qwen3-
0.6B's ``q`` ``[8, 16, 384, 128]`` / ``k`` ``[8, 8, 384, 128]`` (transposed views, as HF makes
them), one 3072-token packed row, and Qwen3-4B's 32/8 heads. For each, bf16, forward and forward
+ backward (``torch.autograd.grad`` of the inputs and, for the norm, the weight):

- ``*_ms``: device time per call (``triton.testing.do_bench``: CUDA events, median);
- ``*_loop_us``: wall time per call in a back-to-back loop of ``--loop`` calls, one sync at the
  end — what a host-bound training step sees (launch + Python + dispatch cost included);
- ``*_kernels``: CUDA kernels launched per call (``torch.profiler``);
- ``fused_fwd_gbps`` / ``fused_bwd_gbps``: the fused kernels' useful bytes (read the inputs,
  write the outputs) per device second (``fused_bwd_ms``: the backward launches alone).

    python benchmarks/bench_fused.py --out $OUT                         # H200, ~1 min
    TRITON_INTERPRET=1 python benchmarks/bench_fused.py --smoke         # CPU: the script runs

Results: ``<--out>/bench_fused.json`` and ``.png`` (forward + backward loop us per case).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, paired_bars, save  # noqa: E402

import torch  # noqa: E402

from polynya.kernels.norm import op as norm_op  # noqa: E402
from polynya.kernels.norm import rms_norm  # noqa: E402
from polynya.kernels.rope import op as rope_op  # noqa: E402
from polynya.kernels.rope import rope  # noqa: E402

EPS = 1e-6


def norm_shapes(tokens: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("norm hidden 1024", (tokens, 1024)), ("norm q 16x128", (tokens, 16, 128)),
            ("norm k 8x128", (tokens, 8, 128)), ("norm hidden 2560", (tokens, 2560)),
            ("norm hidden 8192", (tokens, 8192)), ("norm 16k x 1024", (16384, 1024))]


def rope_shapes(tokens: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, (B, T, Hq, Hk, D))."""
    b = 8 if tokens % 8 == 0 else 1
    return [("rope 16/8 heads", (b, tokens // b, 16, 8, 128)),
            ("rope packed row", (1, tokens, 16, 8, 128)),
            ("rope 32/8 heads", (b, tokens // b, 32, 8, 128))]


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


def norm_case(shape: tuple[int, ...], device: str):
    """-> (arms {name: fn(*inputs) -> outputs}, inputs needing grads, grad outputs, bytes moved
    forward, a backward-only closure of the fused kernels)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
    module = Qwen3RMSNorm(shape[-1], eps=EPS).to(device=device, dtype=torch.bfloat16)
    w = module.weight
    with torch.no_grad():
        _, rstd, x2 = norm_op.rms_norm_forward(x, w, EPS)
    arms = {"hf": lambda: module(x), "fused": lambda: rms_norm(x, w, EPS)}
    nbytes = x.numel() * x.element_size()
    return (arms, (x, w), (dy,), 2 * nbytes, 3 * nbytes,
            lambda: norm_op.rms_norm_backward(dy, x2, w, rstd, True))


def rope_case(dims: tuple[int, ...], device: str):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    b, t, hq, hk, d = dims
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*s):
        return torch.randn(*s, device=device, generator=g).to(torch.bfloat16)

    q = rand(b, t, hq, d).transpose(1, 2).requires_grad_()
    k = rand(b, t, hk, d).transpose(1, 2).requires_grad_()
    cos, sin = rand(b, t, d), rand(b, t, d)
    gq, gk = rand(b, hq, t, d), rand(b, hk, t, d)
    arms = {"hf": lambda: apply_rotary_pos_emb(q, k, cos, sin),
            "fused": lambda: rope(q, k, cos, sin)}
    nbytes = (q.numel() + k.numel()) * q.element_size()
    return (arms, (q, k), (gq, gk), 2 * nbytes, 2 * nbytes,
            lambda: rope_op.rope_launch(gq, gk, cos, sin, backward=True))


def measure(name: str, case, device: str, loop: int) -> dict:
    arms, inputs, grads, fwd_bytes, bwd_bytes, fused_bwd = case
    row = {"case": name, "dims": "x".join(map(str, inputs[0].shape))}
    for arm, f in arms.items():
        def fwd(f=f):
            with torch.no_grad():
                f()

        def fwd_bwd(f=f):
            out = f()
            torch.autograd.grad(out if isinstance(out, tuple) else (out,), inputs, grads)

        for kind, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            row[f"{arm}_{kind}_ms"] = round(device_ms(fn, device), 4)
            row[f"{arm}_{kind}_loop_us"] = round(loop_us(fn, device, loop), 1)
            row[f"{arm}_{kind}_kernels"] = kernels_per_call(fn, device)
    row["fused_bwd_ms"] = round(device_ms(fused_bwd, device), 4)
    row["fused_fwd_gbps"] = round(fwd_bytes / (row["fused_fwd_ms"] * 1e-3) / 1e9, 1)
    row["fused_bwd_gbps"] = round(bwd_bytes / (row["fused_bwd_ms"] * 1e-3) / 1e9, 1)
    for kind in ("fwd", "fwd_bwd"):
        row[f"{kind}_speedup"] = round(row[f"hf_{kind}_ms"] / row[f"fused_{kind}_ms"], 2)
        hf_us, fused_us = row[f"hf_{kind}_loop_us"], row[f"fused_{kind}_loop_us"]
        row[f"{kind}_loop_speedup"] = round(hf_us / fused_us, 2)
    return row


def plot(json_path: str) -> None:
    """The PNG next to the JSON: HF vs fused forward + backward, per call in a loop."""
    import json

    with open(json_path) as f:
        results = json.load(f)
    rows = results["rows"]
    paired_bars(json_path.replace(".json", ".png"), [r["case"].replace(" ", "\n", 1) for r in rows],
                [r["hf_fwd_bwd_loop_us"] for r in rows], "HF",
                [r["fused_fwd_bwd_loop_us"] for r in rows], "polynya fused",
                "fwd+bwd us per call (back-to-back loop)",
                title=f"RMSNorm and RoPE forward + backward, bf16, per call, {results.get('gpu', '')}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8 * 384)
    ap.add_argument("--loop", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (Triton interpreter)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of an earlier run's JSON")
    args = ap.parse_args()
    if args.replot:
        plot(args.replot)
        return
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        norm_op.KERNEL_ON_CPU = rope_op.KERNEL_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
        todo = [("norm smoke", norm_case((5, 3, 40), device)),
                ("rope smoke", rope_case((2, 3, 4, 2, 16), device))]
        args.loop = 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_fused.py needs a CUDA GPU (or --smoke on CPU)")
        todo = ([(n, norm_case(s, device)) for n, s in norm_shapes(args.tokens)]
                + [(n, rope_case(s, device)) for n, s in rope_shapes(args.tokens)])
    rows = []
    for name, case in todo:
        rows.append(measure(name, case, device, args.loop))
        print(rows[-1], flush=True)
    path = save(dict(environment(), tokens=args.tokens, loop=args.loop, dtype="bfloat16",
                     rows=rows), args.out, "bench_fused")
    plot(path)
    print(markdown_table(rows, [
        ("case", "case"), ("dims", "dims"), ("hf_fwd_ms", "HF fwd ms"),
        ("fused_fwd_ms", "fused fwd ms"), ("fused_fwd_gbps", "fused fwd GB/s"),
        ("hf_fwd_bwd_ms", "HF fwd+bwd ms"), ("fused_fwd_bwd_ms", "fused fwd+bwd ms"),
        ("fused_bwd_ms", "fused bwd ms"), ("fused_bwd_gbps", "fused bwd GB/s"),
        ("hf_fwd_bwd_kernels", "HF kernels"),
        ("fused_fwd_bwd_kernels", "fused kernels"), ("hf_fwd_bwd_loop_us", "HF loop us"),
        ("fused_fwd_bwd_loop_us", "fused loop us"), ("fwd_bwd_loop_speedup", "loop speed-up")]))


if __name__ == "__main__":
    main()

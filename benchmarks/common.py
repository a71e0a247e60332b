"""Small helpers shared by the benchmark scripts (not collected by pytest)."""
from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import threading
import time
from typing import Self

import numpy as np
import torch

H200_HBM_BYTES_PER_S = 4.4e12   # measured device-to-device copy here
H200_BF16_FLOPS = 790e12        # measured 8192^3 bf16 GEMM here


def cuda_median_ms(fn, *, warmup: int = 3, iters: int = 10) -> list[float]:
    """Run ``fn`` warmup + iters times; return each timed run in ms (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def make_prompts(groups: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``groups`` random prompts of ``length`` ids (fresh per seed: no prefix-cache carry-over)."""
    g = np.random.default_rng(seed)
    return [g.integers(100, vocab - 100, size=length).tolist() for _ in range(groups)]


def add_sampler_shape_args(ap) -> None:
    """The sampler benchmarks' shared flags: model and dtype (a Qwen3-0.6B shape in bf16 on
    CUDA, the tiny model in fp32 elsewhere), prompts x G, lengths, block size, repeats."""
    cuda = torch.cuda.is_available()
    ap.add_argument("--model", default="random:qwen3-0.6b" if cuda else "tiny:qwen3")
    ap.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per arm (median reported)")


def median(xs) -> float:
    return float(statistics.median(xs))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_median_ms(fn, *, warmup: int = 1, iters: int = 5) -> float:
    """Median wall-clock ms of ``fn`` over ``iters`` runs after ``warmup``, the device
    synchronised around each run (host work included, unlike ``cuda_median_ms``)."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def busy_ms(events) -> float:
    """Union of the device kernels' [start, end) intervals (``torch.profiler`` events), in ms."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3


_ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def _dynamo_compiles() -> int:
    """Frames Dynamo has compiled so far in this process (a recompile counts too)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


class _GCTimer:
    """Time spent in Python's garbage collector while active (a ``gc.callbacks`` hook)."""

    def __init__(self) -> None:
        self.ms, self.collections, self._t0 = 0.0, [0, 0, 0], None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.collections[info["generation"]] += 1
            self._t0 = None

    def __enter__(self) -> Self:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def profile_call(fn, top: int = 12):
    """``fn()`` once under ``torch.profiler`` (CUDA-synchronised): its result and a dict of wall
    ms, GPU-busy ms (the gap is host time the GPU waited for), kernels launched, the caching
    allocator's counters over the call (``cudaMalloc`` / ``cudaFree`` calls, retries after
    freeing its cache), the frames Dynamo compiled during the call (recompiles), the time spent
    in Python's garbage collector (collections per generation), the live Python threads and the
    ``top`` host calls by self CPU time."""
    cuda = torch.cuda.is_available()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    before = torch.cuda.memory_stats() if cuda else {}
    compiles = _dynamo_compiles()
    with torch.profiler.profile(activities=acts) as prof, _GCTimer() as gc_time:
        _sync()
        t0 = time.perf_counter()
        result = fn()
        _sync()
        wall = (time.perf_counter() - t0) * 1e3
    after = torch.cuda.memory_stats() if cuda else {}
    compiles = _dynamo_compiles() - compiles
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    hot = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return result, {"wall_ms": round(wall, 1), "gpu_busy_ms": round(busy_ms(kernels), 1) if kernels else None,
                    "kernels": len(kernels), "dynamo_compiles": compiles,
                    "gc_ms": round(gc_time.ms, 1), "gc_collections": gc_time.collections,
                    "python_threads": threading.active_count(),
                    **{k: after.get(k, 0) - before.get(k, 0) for k in _ALLOCATOR},
                    "top_cpu": [(e.key[:70], round(e.self_cpu_time_total / 1e3, 1), e.count) for e in hot]}


def environment() -> dict:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
    }


def save(results: dict, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    return path


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(str(r[key]) for key, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def paired_bars(path: str, labels: list[str], a: list[float], a_label: str, b: list[float],
                b_label: str, ylabel: str, title: str = "", ref_line: float | None = None,
                log: bool = False) -> None:
    """Two bars per x label (e.g. measured vs ideal speedup) saved as a PNG, with a title and
    an optional horizontal reference line (1.0 for speedups); no-op without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], a, 0.4, label=a_label)
    ax.bar([x + 0.2 for x in xs], b, 0.4, label=b_label)
    ax.set_xticks(list(xs), labels, fontsize=7 if len(labels) > 5 else 9)
    for x, v in zip(xs, a):
        ax.text(x - 0.2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    if ref_line is not None:
        ax.axhline(ref_line, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

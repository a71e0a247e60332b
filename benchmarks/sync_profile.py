"""Host-time profile arm of ``bench_sync.py --profile``: where a CUDA-IPC sync's time goes.

- ``profile_syncs``: cProfile of span syncs in the trainer and in the sampler process (the
  sampler side is switched on and read back over the bench's pipe: ``("profile", on)``);
- ``trainer_phases``: the trainer's pieces alone (span layout check, the walk it replaced,
  digest + transfer + lines, ``build_manifest`` with and without the ``step()`` digest, the
  export's re-check), device synchronised, median ms;
- ``receiver_phases``: the receive path's pieces on the real IPC buckets (layout lookup, plan
  lookup, ``verify``, the check kernels alone, and the verified load when the buckets hold the
  weights the sampler already serves: its weights and version stay).
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
import traceback

import torch
from common import median


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def receiver_phases(engine, manifest, handles, iters: int = 10) -> dict:
    """Median ms of each piece of the receive path on buckets opened from ``handles``: the
    plan lookup, ``verify`` (check pass + transfer + compare), the check kernels alone, and
    (when the buckets hold the weights the engine already serves) the verified load itself.
    The engine's weights and version stay as they were."""
    from polynya.sync import open_shared

    try:
        opened = open_shared(manifest, handles)
        pieces = opened.staged.pieces()
        runner = engine.backend.runner
        plan = runner._verified_plan(pieces)  # noqa: SLF001 (a bench looks inside)
        flats = pieces.flats
        arms = {
            "pieces (bucket layout lookup)": lambda: opened.staged.pieces(),
            "plan lookup (+ pointer check)": lambda: runner._verified_plan(pieces),  # noqa: SLF001
            "verify (check pass + transfer + compare)": lambda: plan.verify(flats,
                                                                            manifest.checksum),
            "check kernels alone": lambda: plan.plan.check(flats),
        }
        if manifest.checksum == engine.weight_checksum():  # the bytes it serves already: a
            # verified load of them changes nothing, so its time can be taken (the version stays)
            arms["load (verify + copy pass)"] = lambda: plan.load(flats, manifest.checksum)
        out = {}
        for name, fn in arms.items():
            times = []
            for _ in range(iters):
                _sync()
                t0 = time.perf_counter()
                fn()
                _sync()
                times.append((time.perf_counter() - t0) * 1e3)
            out[name] = median(times)
        opened.close()
        return out
    except Exception:  # noqa: BLE001 (reported, the bench goes on)
        return {"error": traceback.format_exc()}


def top(prof, n: int = 30) -> str:
    """The ``n`` functions with the most own time, then the most cumulative time."""
    if prof is None:
        return ""
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(n)
    stats.sort_stats("cumtime").print_stats(n)
    return buf.getvalue()


def trainer_phases(trainer, iters: int = 20) -> str:
    """Median wall time of the trainer's sync pieces, each alone, device synchronised."""
    from polynya.spans import span_layout
    from polynya.sync import SharedExport, build_manifest

    found = span_layout(trainer.module)
    if found is None:
        return "trainer pieces: the weights are not spans of flat storages\n\n"
    layout, spans = found

    manifest = build_manifest(trainer, version=1, bucket_bytes=1 << 28, layout="spans")

    pieces = {
        "span_layout (walk + key check)": lambda: span_layout(trainer.module),
        "named_parameters() (the walk before)": lambda: list(trainer.module.named_parameters()),
        "layout.checksum (digest launch + transfer + lines)": lambda: layout.checksum(spans),
        "build_manifest(ready=False)": lambda: build_manifest(
            trainer, version=1, bucket_bytes=1 << 28, layout="spans", ready=False),
        # the export's re-check of the layout; sharing itself (CUDA-IPC handles) is export_s
        "export, not shared (export_spans)": lambda: SharedExport.from_trainer(
            trainer, manifest, 1 << 28, share=False),
        # the RL loop's case: step() launched the digest long before the sync (done by now)
        "build_manifest(ready=True), digest already done": lambda: build_manifest(
            trainer, version=1, bucket_bytes=1 << 28, layout="spans", ready=True),
    }
    lines = ["trainer pieces alone (median ms):"]
    for name, fn in pieces.items():
        times = []
        for _ in range(iters):
            if "ready=True" in name:
                trainer.prepare_checksum()
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            times.append((time.perf_counter() - t0) * 1e3)
        lines.append(f"  {name}: {median(times):.3f}")
    return "\n".join(lines) + "\n\n"


def profile_syncs(one_sync, trainer, conn, version: int, iters: int, out: str) -> int:
    """cProfile of ``iters`` span syncs (``one_sync``, digest launched at ``step()``) in both
    processes: the host time by function, the trainer's and the receiver's pieces timed alone,
    written to ``out/bench_sync_profile_{trainer,receiver}.txt``. Returns the next version."""
    one_sync(trainer, conn, version + 1, "spans", False, True)  # warm
    conn.send(("profile", True))
    conn.recv()
    prof = cProfile.Profile()
    for i in range(iters):
        prof.enable()
        one_sync(trainer, conn, version + 2 + i, "spans", False, True)
        prof.disable()
    conn.send(("profile", False))
    texts = {"trainer": top(prof), "receiver": conn.recv()}
    from polynya.sync import SharedExport, build_manifest

    manifest = build_manifest(trainer, version=version + 2 + iters, bucket_bytes=1 << 28,
                              layout="spans")
    export = SharedExport.from_trainer(trainer, manifest, 1 << 28)
    conn.send(("phases", manifest, export.handles))
    phases = conn.recv()
    export.release()
    texts["receiver"] = ("receiver pieces on the real buckets (median ms):\n" + "\n".join(
        f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}" for k, v in phases.items())
        + "\n\n" + texts["receiver"])
    texts["trainer"] = trainer_phases(trainer) + texts["trainer"]
    os.makedirs(out, exist_ok=True)
    for side, text in texts.items():
        with open(os.path.join(out, f"bench_sync_profile_{side}.txt"), "w") as f:
            f.write(text)
        print(f"--- {side} host profile ({iters} syncs)\n" + "\n".join(text.splitlines()[:45]))
    return version + 2 + iters

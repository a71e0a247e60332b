"""TrainingEngine on one GPU: ZeRO-2/3 bf16 sanity, step time / tokens/s / MFU / peak memory with
ZoRRo on vs off, engine speedup vs the bare ``compute_logprobs`` speedup, offload/onload.

Random-init Qwen3-0.6B-shaped model, bf16, gradient checkpointing, one micro-batch per step.
For each P/R/G shape (``--groups`` prompts x G responses):

- *bare*: ``compute_logprobs`` + backward on a plain HF model (what ``bench_zorro.py`` times),
  naive vs ZoRRo -> the bare speedup, measured right before the engines on the same batch
  (plus the padded naive layout, ``bare_padded_ms``, for reference);

"Naive" is ``zorro=False`` in the packed layout (samples back to back without padding,
FlashAttention-2 varlen: verl's remove-padding), in the bare arm and in the engines (the
``TrainConfig.naive_layout="auto"`` default).
- *engine*: ``TrainingEngine.forward_backward`` + ``step`` (GRPO loss, AdamW) under ZeRO-2 and
  ZeRO-3, naive vs ZoRRo -> the engine speedup; target: >= 90% of the bare speedup.

Memory is the step's peak above what was allocated before it (weights, optimizer state and the
other engine stay resident). Then ``offload()`` / ``onload()`` of each engine alone on the
device (target: >= 90% of its memory freed) and a check that its log-probs after ``onload``
equal those before. ``--profile`` prints the top ops and sync counts of one ZoRRo step, bare vs
engine.

    python benchmarks/bench_engine.py --out benchmarks/results
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import polynya
from bench_zorro import make_batch, model_flops
from common import H200_BF16_FLOPS, environment, markdown_table, median, paired_bars, save
from polynya.config import OptimConfig, TrainConfig
from polynya.models import load_model

SHAPES = [(4096, 512, 8), (256, 512, 8)]


CUDA = torch.cuda.is_available()  # without CUDA (a CPU smoke run) memory reads 0
DEVICE = "cuda" if CUDA else "cpu"


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, iters: int) -> tuple[float, float]:
    """(median seconds, peak bytes above what was allocated before) over ``iters`` runs after
    one warm-up run (other engines stay resident, so the step's own memory is the peak above)."""
    fn()
    _sync()
    base = float(torch.cuda.memory_allocated()) if CUDA else 0.0
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return median(times), float(torch.cuda.max_memory_allocated()) - base if CUDA else 0.0


def _free() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def guarded(what: str, fn, *args):
    """Run ``fn``; on an exception print it and return ``{"error": ...}`` (one GPU run, all the
    numbers it can give)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported, never hidden
        import traceback

        traceback.print_exc()
        print(f"FAILED {what}: {type(exc).__name__}: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}


def bare_model(model_spec: str):
    model = load_model(model_spec, dtype="bfloat16", device=DEVICE)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def bare_step(model, batch, zorro: bool, naive_layout: str = "packed"):
    """What bench_zorro.py times: compute_logprobs + backward, no optimizer."""
    def fn():
        st = polynya.compute_logprobs(model, batch, zorro=zorro, naive_layout=naive_layout)
        adv = batch.advantages.to(st.logprobs.device)[:, None]
        (-(st.logprobs * adv).sum() / st.mask.sum()).backward()
        model.zero_grad(set_to_none=True)
    return fn


def engine_step(engine, cfg, batch, zorro: bool):
    def fn():
        engine.config = dataclasses.replace(cfg, zorro=zorro)
        engine.forward_backward(batch)
        engine.step()
    return fn


def sanity(engine, vocab: int) -> dict:
    """3 off-policy GRPO steps on a small batch: finite, decreasing loss; export/checksum."""
    batch = make_batch(64, 32, 4, 4, vocab, seed=1)
    lp = engine.compute_logprobs(batch).logprobs.cpu()
    noise = 0.1 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(0))
    batch = polynya.RolloutBatch(batch.prompts, batch.responses, advantages=batch.advantages,
                                 old_logprobs=lp + noise)
    losses, norms = [], []
    for _ in range(3):
        losses.append(engine.forward_backward(batch)["loss"])
        norms.append(engine.step()["grad_norm"])
    numel = sum(flat.numel() for _, flat in engine.export_weights(1 << 27))
    n_params = sum(math.prod(engine_full_shape(p)) for p in engine.module.parameters())
    ok = all(map(math.isfinite, losses + norms)) and losses[-1] < losses[0] and numel == n_params
    return {"losses": [round(x, 5) for x in losses], "grad_norms": [round(x, 4) for x in norms],
            "export_numel_ok": numel == n_params, "ok": ok}


def engine_full_shape(p):
    from polynya.engines._deepspeed import full_shape

    return full_shape(p)


def engine_config(model_spec: str, stage: int) -> TrainConfig:
    return TrainConfig(model_spec, dtype="bfloat16", zero_stage=stage, lr=1e-5, loss="grpo",
                       gradient_checkpointing=True, log_entropy=False, micro_batch_tokens=1 << 20,
                       optim=OptimConfig(grad_clip=1.0))


def shape_rows(model, engines: dict, shape, groups: int, iters: int) -> list[dict]:
    """Bare and every engine, naive and ZoRRo, back to back on one batch (same compile state)."""
    P, R, G = shape
    mcfg = model.config
    batch = make_batch(P, R, G, groups, mcfg.vocab_size, seed=P + R + G)
    bare = {z: timed(bare_step(model, batch, z), iters) for z in (False, True)}
    padded = timed(bare_step(model, batch, False, "padded"), iters)[0]
    name = f"P{P}/R{R}/G{G}"
    print(f"bare {name}: naive packed {bare[False][0]*1e3:.0f} ms, padded {padded*1e3:.0f} ms, "
          f"zorro {bare[True][0]*1e3:.0f} ms", flush=True)
    bare_speedup = bare[False][0] / bare[True][0]
    fz, fn_ = (model_flops(mcfg, P, R, G, groups, z) for z in (True, False))
    sample_tokens = groups * G * (P + R)
    rows = []
    for stage, (engine, cfg) in engines.items():
        res = {z: timed(engine_step(engine, cfg, batch, z), iters) for z in (False, True)}
        engine.config = cfg
        (tn, pn), (tz, pz) = res[False], res[True]
        pn, pz = max(pn, 1.0), max(pz, 1.0)
        speedup = tn / tz
        rows.append(dict(stage=stage, shape=name, naive_ms=round(tn * 1e3, 1), zorro_ms=round(tz * 1e3, 1),
                         speedup=round(speedup, 2), bare_naive_ms=round(bare[False][0] * 1e3, 1),
                         bare_zorro_ms=round(bare[True][0] * 1e3, 1), bare_speedup=round(bare_speedup, 2),
                         bare_padded_ms=round(padded * 1e3, 1),
                         kept=round(speedup / bare_speedup, 3),
                         naive_tok_s=round(sample_tokens / tn), zorro_tok_s=round(sample_tokens / tz),
                         naive_mfu=round(fn_ / tn / H200_BF16_FLOPS, 3), zorro_mfu=round(fz / tz / H200_BF16_FLOPS, 3),
                         naive_step_gb=round(pn / 2**30, 2), zorro_step_gb=round(pz / 2**30, 2),
                         mem_ratio=round(pz / pn, 3)))
        print(rows[-1], flush=True)
    return rows


def profile(model, engines: dict, shape, groups: int) -> None:
    """One ZoRRo step, bare vs each engine: top ops and host-device syncs (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    P, R, G = shape
    batch = make_batch(P, R, G, groups, model.config.vocab_size, seed=P + R + G)
    runs = {"bare": bare_step(model, batch, True)}
    runs.update({f"zero{s}": engine_step(e, c, batch, True) for s, (e, c) in engines.items()})
    for name, fn in runs.items():
        fn()
        _sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        with tprofile(activities=acts) as prof:
            fn()
            _sync()
        table = prof.key_averages()
        syncs = sum(e.count for e in table if "Synchronize" in e.key)
        print(f"--- profile {name} P{P}/R{R}/G{G}: {syncs} synchronize calls", flush=True)
        sort = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
        print(table.table(sort_by=sort, row_limit=12, max_name_column_width=60), flush=True)


def offload_check(engine, vocab: int) -> dict:
    probe = make_batch(128, 32, 4, 2, vocab, seed=7)
    before_lp = engine.compute_logprobs(probe).logprobs
    _free()
    off = engine.offload()
    engine.onload()
    same = torch.equal(engine.compute_logprobs(probe).logprobs, before_lp)
    return {"before_gb": round(off["before"] / 2**30, 2), "after_gb": round(off["after"] / 2**30, 3),
            "freed_fraction": round(off["freed_fraction"], 3), "logprobs_equal_after_onload": same}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(f"{p}/{r}/{g}" for p, r, g in SHAPES))
    ap.add_argument("--profile", action="store_true", help="profile one ZoRRo step (first shape)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split("/"))) for s in args.shapes.split(",")]

    model = bare_model(args.model)
    engines, extras = {}, {}
    for stage in map(int, args.stages.split(",")):
        from polynya.engines import TrainingEngine

        cfg = engine_config(args.model, stage)
        engine = guarded(f"ZeRO-{stage} init", TrainingEngine, cfg)
        if isinstance(engine, dict):
            extras[f"zero{stage}"] = {"init": engine}
            continue
        engines[stage] = (engine, cfg)
        extras[f"zero{stage}"] = {"sanity": guarded("sanity", sanity, engine, model.config.vocab_size)}
        print(f"ZeRO-{stage} sanity: {extras[f'zero{stage}']['sanity']}", flush=True)
    rows = []
    for shape in shapes:
        got = guarded(f"shape {shape}", shape_rows, model, engines, shape, args.groups, args.iters)
        rows += got if isinstance(got, list) else []
    if args.profile:
        guarded("profile", profile, model, engines, shapes[0], args.groups)
    vocab = model.config.vocab_size
    del model
    _free()
    for engine, _ in engines.values():  # each engine's offload is measured with the others away
        guarded("offload", engine.offload)
    for stage, (engine, _) in engines.items():
        engine.onload()
        extras[f"zero{stage}"]["offload"] = guarded("offload", offload_check, engine, vocab)
        print(f"ZeRO-{stage} offload: {extras[f'zero{stage}']['offload']}", flush=True)
        guarded("offload", engine.offload)
    save(dict(environment(), model=args.model, groups=args.groups, dtype="bfloat16",
              gradient_checkpointing=True, rows=rows, **extras), args.out, "bench_engine")
    paired_bars(os.path.join(args.out, "bench_engine.png"), [f"Z{r['stage']} {r['shape']}" for r in rows],
                [r["speedup"] for r in rows], "engine speedup", [r["bare_speedup"] for r in rows],
                "bare compute_logprobs", "naive / ZoRRo step time")
    for key, extra in extras.items():
        print(f"{key}: {extra}")
    print(markdown_table(rows, [("stage", "ZeRO"), ("shape", "P/R/G"), ("naive_ms", "naive ms"),
                                ("zorro_ms", "ZoRRo ms"), ("speedup", "speedup"),
                                ("bare_naive_ms", "bare naive ms"), ("bare_zorro_ms", "bare ZoRRo ms"),
                                ("bare_padded_ms", "bare padded ms"),
                                ("bare_speedup", "bare speedup"), ("kept", "kept"),
                                ("naive_tok_s", "naive tok/s"), ("zorro_tok_s", "ZoRRo tok/s"),
                                ("naive_mfu", "naive MFU"), ("zorro_mfu", "ZoRRo MFU"),
                                ("naive_step_gb", "naive step GB"), ("zorro_step_gb", "ZoRRo step GB"),
                                ("mem_ratio", "step-mem ratio")]))


if __name__ == "__main__":
    main()

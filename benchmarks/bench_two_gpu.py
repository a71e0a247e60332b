"""Two GPUs of one host: split placement, NCCL weight broadcast, one-step-off overlap, ZeRO-2 DP.

Processes are driven with ``torch.multiprocessing`` (Ray's wheel cannot be carried to the GPU
machine); they run the same engines and sync code (``polynya.sync``) the Ray transport uses.

1. *Split placement*: ``TrainingEngine`` (ZeRO-2, bf16) alone on GPU 0, the native sampler alone
   on GPU 1. Each GRPO-style step: the sampler generates ``prompts x G`` rollouts, the trainer
   scores them (a toy token reward), trains one step, then broadcasts its weights over NCCL
   (``build_manifest`` / ``send_weights`` / ``recv_weights`` / ``apply_update``: bucketed,
   checksum verified by the receiver before anything is loaded). After every sync the sampler's
   ``weight_checksum()`` is compared with the trainer's. Time per sync and GB/s against the
   peer-to-peer copy of the same bytes GPU 0 -> GPU 1 measured in this run.
2. *Overlap* (one step off-policy): while the trainer trains step n, the sampler generates step
   n+1's rollouts with the weights of step n-1; then the weights of step n are broadcast. Step
   time against (1) and against the colocated one-GPU step (sampler and trainer in one process
   on GPU 0, in-process ``load_weights(export_weights())``), and the rollout/trainer log-prob gap
   that staleness causes (mean |sampler log-prob - trainer log-prob| per token, vs (1)'s gap).
3. *Data parallel*: ZeRO-2 on 2 ranks (NCCL) against 1 rank on the same global batch of whole
   prompt groups: losses and grad norms of 3 steps, step time, scaling.
4. *Failure* (kill / stop the sampler or the trainer mid-sync, resync): its own script,
   ``benchmarks/probe_sync_failure.py``.

    python benchmarks/bench_two_gpu.py --out benchmarks/results          # needs 2 GPUs
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, median, save  # noqa: E402

MODEL = "random:qwen3-0.6b"
BUCKET = 256 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _on_gpu(index: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (KINDS.md)


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (num, length), generator=g).tolist()


def grpo_batch(prompts, groups, logprobs=True):
    """Rollouts -> ``RolloutBatch`` with group-normalised advantages of a toy reward
    (fraction of even token ids); the sampler's log-probs ride along for the gap metric."""
    from polynya import RolloutBatch

    p_ids, r_ids, adv, lps = [], [], [], []
    for prompt, samples in zip(prompts, groups):
        rewards = torch.tensor([sum(t % 2 == 0 for t in s.token_ids) / max(len(s.token_ids), 1)
                                for s in samples])
        a = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for s, ai in zip(samples, a.tolist()):
            p_ids.append(prompt)
            r_ids.append(list(s.token_ids))
            adv.append(ai)
            lps.append(list(s.logprobs) if logprobs else None)
    return RolloutBatch(p_ids, r_ids, advantages=adv), lps


def logprob_gap(trainer, batch, sampler_lps) -> float:
    """Mean |trainer log-prob - sampler log-prob| over response tokens."""
    with torch.no_grad():
        stats = trainer.compute_logprobs(batch)
    lp, mask = stats.logprobs.float().cpu(), stats.mask.cpu()
    ref = torch.zeros_like(lp)
    for i, row in enumerate(sampler_lps):
        ref[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return float(((lp - ref).abs() * mask).sum() / mask.sum())


# ---------------------------------------------------------------- sampler process (GPU 1)
def sampler_main(conn, model: str, port: int) -> None:
    _on_gpu(1)
    try:
        from polynya.config import SamplerConfig
        from polynya.engines import SamplingEngine
        from polynya.sync import SyncGroup, apply_update, recv_weights

        engine = SamplingEngine(SamplerConfig(model, dtype="bfloat16", device="cuda"))
        group = SyncGroup("127.0.0.1", port, rank=1, world_size=2, device="cuda")
        conn.send(("ready", None))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            t0 = time.perf_counter()
            if cmd == "generate":
                prompts, params = arg
                out = engine.generate(prompts, params)
                conn.send(("generated", (out, time.perf_counter() - t0)))
            elif cmd == "sync":  # phases: receive (waits for the trainer's sends), verify + apply
                staged = recv_weights(group, arg, "cuda")
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                version = apply_update(engine, staged)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                checksum = engine.weight_checksum()  # the bench's own check, not part of the sync
                conn.send(("synced", (version, checksum, {
                    "recv_ms": (t1 - t0) * 1e3, "apply_ms": (t2 - t1) * 1e3,
                    "check_ms": (time.perf_counter() - t2) * 1e3})))
        group.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


_STASH: dict = {}


def _expect(conn, tag):
    """The next message tagged ``tag`` (others are kept for later: in overlap mode a
    ``generated`` answer can arrive before the ``synced`` one the trainer waits for)."""
    if tag in _STASH:
        return _STASH.pop(tag)
    while True:
        got, value = conn.recv()
        if got == "error":
            raise RuntimeError(f"sampler process failed:\n{value}")
        if got == tag:
            return value
        assert got not in _STASH, f"two unclaimed {got!r} messages"
        _STASH[got] = value


# ---------------------------------------------------------------- trainer process (GPU 0)
def trainer_main(out_q, model: str, port: int, steps: int, shape: dict, overlap: bool) -> None:
    _on_gpu(0)
    try:
        out_q.put(("result", run_split(model, port, steps, shape, overlap)))
    except Exception:
        out_q.put(("error", traceback.format_exc()))


def run_split(model, port, steps, shape, overlap) -> dict:
    from polynya import SamplingParams
    from polynya.config import TrainConfig
    from polynya.engines import TrainingEngine
    from polynya.sync import SyncGroup, build_manifest, send_weights

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=sampler_main, args=(child, model, port), daemon=True)
    proc.start()
    trainer = TrainingEngine(TrainConfig(model, dtype="bfloat16", zero_stage=2, lr=1e-6,
                                         loss="grpo", device="cuda"))
    group = SyncGroup("127.0.0.1", port, rank=0, world_size=2, device="cuda")
    _expect(conn, "ready")
    vocab = trainer.module.config.vocab_size
    params = SamplingParams(n=shape["G"], temperature=1.0, max_tokens=shape["new"], logprobs=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in trainer.module.parameters())

    def sync(version):
        t0 = time.perf_counter()
        manifest = build_manifest(trainer, version=version, bucket_bytes=BUCKET)
        t1 = time.perf_counter()
        conn.send(("sync", manifest))
        send_weights(group, trainer, manifest, BUCKET)
        got_version, checksum, phases = _expect(conn, "synced")
        total_ms = (time.perf_counter() - t0) * 1e3 - phases["check_ms"]  # without the bench's check
        return {"version": got_version, "verified": checksum == trainer.weight_checksum(),
                "manifest_ms": (t1 - t0) * 1e3, "sync_ms": total_ms,
                "recv_apply_ms": phases["recv_ms"] + phases["apply_ms"], **phases}

    first = sync(1)  # the sampler starts from the trainer's weights (version 1)
    rows = []
    prompts = [make_prompts(shape["prompts"], shape["P"], vocab, seed=s) for s in range(steps + 1)]
    if overlap:
        conn.send(("generate", (prompts[0], params)))
    for step in range(steps):
        t0 = time.perf_counter()
        if not overlap:
            conn.send(("generate", (prompts[step], params)))
        groups, gen_s = _expect(conn, "generated")
        t_gen = time.perf_counter()
        if overlap and step + 1 < steps:  # step n+1's rollouts on the weights of step n-1
            conn.send(("generate", (prompts[step + 1], params)))
        batch, lps = grpo_batch(prompts[step], groups)
        gap = logprob_gap(trainer, batch, lps)
        t_lp = time.perf_counter()
        metrics = trainer.forward_backward(batch)
        info = trainer.step()
        torch.cuda.synchronize()
        t_train = time.perf_counter()
        s = sync(step + 2)  # overlap: waits until the sampler has finished step n+1's rollouts
        rows.append({"step": step, "step_ms": (time.perf_counter() - t0) * 1e3,
                     "wait_generate_ms": (t_gen - t0) * 1e3, "sampler_generate_ms": gen_s * 1e3,
                     "gap_logprob_ms": (t_lp - t_gen) * 1e3, "train_ms": (t_train - t_lp) * 1e3,
                     "gap": gap, "loss": metrics["loss"], "grad_norm": info["grad_norm"], **s})
    conn.send(("stop", None))
    proc.join(timeout=60)
    group.close()
    return {"weight_bytes": weight_bytes, "first_sync": first, "steps": rows}


# ---------------------------------------------------------------- colocated baseline (GPU 0)
def colocated_main(out_q, model: str, steps: int, shape: dict) -> None:
    _on_gpu(0)
    try:
        from polynya import SamplingParams
        from polynya.config import SamplerConfig, TrainConfig
        from polynya.engines import SamplingEngine, TrainingEngine

        trainer = TrainingEngine(TrainConfig(model, dtype="bfloat16", zero_stage=2, lr=1e-6,
                                             loss="grpo", device="cuda"))
        sampler = SamplingEngine(SamplerConfig(model, dtype="bfloat16", device="cuda"))
        sampler.load_weights(trainer.export_weights(BUCKET))
        vocab = trainer.module.config.vocab_size
        params = SamplingParams(n=shape["G"], temperature=1.0, max_tokens=shape["new"], logprobs=True)
        rows = []
        for step in range(steps):
            prompts = make_prompts(shape["prompts"], shape["P"], vocab, seed=step)
            t0 = time.perf_counter()
            groups = sampler.generate(prompts, params)
            t1 = time.perf_counter()
            batch, _ = grpo_batch(prompts, groups)
            trainer.forward_backward(batch)
            trainer.step()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            sampler.load_weights(trainer.export_weights(BUCKET))
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            rows.append({"step": step, "step_ms": (t3 - t0) * 1e3, "generate_ms": (t1 - t0) * 1e3,
                         "train_ms": (t2 - t1) * 1e3, "sync_ms": (t3 - t2) * 1e3})
        out_q.put(("result", {"steps": rows}))
    except Exception:
        out_q.put(("error", traceback.format_exc()))


# ---------------------------------------------------------------- data parallel
def dp_rank(rank: int, world: int, port: int, model: str, shape: dict, out_q) -> None:
    _on_gpu(rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        from polynya import RolloutBatch
        from polynya.config import TrainConfig
        from polynya.engines import TrainingEngine

        trainer = TrainingEngine(TrainConfig(model, dtype="bfloat16", zero_stage=2, lr=1e-5,
                                             loss="grpo", device="cuda"))
        vocab = trainer.module.config.vocab_size
        g = torch.Generator().manual_seed(7)
        prompts, responses = [], []
        for p in make_prompts(shape["prompts"], shape["P"], vocab, seed=99):
            for _ in range(shape["G"]):
                n = int(torch.randint(shape["new"] // 2, shape["new"] + 1, (1,), generator=g))
                prompts.append(p)
                responses.append(torch.randint(10, vocab - 10, (n,), generator=g).tolist())
        adv = torch.randn(len(prompts), generator=g).tolist()
        batch = RolloutBatch(prompts, responses, advantages=adv)
        steps = []
        for _ in range(4):  # the first is warm-up for timing; all are compared
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = trainer.forward_backward(batch)
            info = trainer.step()
            torch.cuda.synchronize()
            steps.append({"loss": m["loss"], "grad_norm": info["grad_norm"],
                          "micro_batches": m["micro_batches"],
                          "ms": (time.perf_counter() - t0) * 1e3})
        if rank == 0:
            out_q.put(("result", {"world": world, "steps": steps, "tokens": sum(map(len, responses))
                                  + sum(map(len, prompts))}))
    except Exception:
        out_q.put(("error", traceback.format_exc()))


def run_dp(model: str, shape: dict, world: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=dp_rank, args=(r, world, port, model, shape, q)) for r in range(world)]
    for p in procs:
        p.start()
    tag, value = q.get(timeout=900)
    for p in procs:
        p.join(timeout=120)
    if tag == "error":
        raise RuntimeError(value)
    return value


def _child(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args))
    p.start()
    tag, value = q.get(timeout=900)
    p.join(timeout=120)
    if tag == "error":
        raise RuntimeError(value)
    return value


def p2p_copy(weight_bytes: int) -> dict:
    """GPU 0 -> GPU 1 copy and GPU 0 HBM copy of ``weight_bytes`` (CUDA events, median of 20)."""
    n = weight_bytes // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda:0")
    out = {}
    for name, dst in (("p2p", torch.empty(n, dtype=torch.bfloat16, device="cuda:1")),
                      ("hbm", torch.empty_like(src))):
        times = []
        for i in range(25):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            torch.cuda.synchronize()
            if i >= 5:
                times.append(a.elapsed_time(b))
        assert torch.equal(dst.cpu(), src.cpu())
        ms = median(times)
        out[name] = {"ms": ms, "GBps": weight_bytes / ms / 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--only", default="split,overlap,colocated,dp")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("bench_two_gpu needs 2 GPUs")
    shape = {"prompts": args.prompts, "G": args.group, "P": args.prompt_len, "new": args.new_tokens}
    only = set(args.only.split(","))
    res: dict = {"env": environment(), "shape": shape, "model": args.model}
    for name, fn in (
        ("split", lambda: _child(trainer_main, args.model, free_port(), args.steps, shape, False)),
        ("overlap", lambda: _child(trainer_main, args.model, free_port(), args.steps, shape, True)),
        ("colocated", lambda: _child(colocated_main, args.model, args.steps, shape)),
        ("dp1", lambda: run_dp(args.model, shape, 1)),
        ("dp2", lambda: run_dp(args.model, shape, 2)),
    ):
        if name.rstrip("12") not in only:
            continue
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as exc:  # keep what the other parts measured
            res[name] = {"error": str(exc)[-3000:]}
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save(res, args.out, "bench_two_gpu")
    if "split" in res and "weight_bytes" in res["split"]:
        res["copy"] = p2p_copy(res["split"]["weight_bytes"])
    save(res, args.out, "bench_two_gpu")
    report(res)
    plot(res, os.path.join(args.out, "bench_two_gpu.png"))


def report(res: dict) -> None:
    rows = []
    for arm in ("split", "overlap", "colocated"):
        steps = res.get(arm, {}).get("steps")
        if not steps:
            continue
        warm = steps[1:] or steps
        rows.append({"arm": arm, "step": f"{median([s['step_ms'] for s in warm]):.0f}",
                     "sync": f"{median([s.get('sync_ms', 0.0) for s in warm]):.1f}",
                     "gap": f"{median([s.get('gap', float('nan')) for s in warm]):.4f}",
                     "verified": all(s.get("verified", True) for s in steps)})
    print(markdown_table(rows, [("arm", "arm"), ("step", "step ms (median, warm)"),
                                ("sync", "sync ms"), ("gap", "log-prob gap"),
                                ("verified", "checksums equal")]))
    if "copy" in res and "split" in res:
        sync_ms = median([s["sync_ms"] for s in res["split"]["steps"][1:]])  # warm, as the table
        gbps = res["split"]["weight_bytes"] / sync_ms / 1e6
        print(f"sync {gbps:.1f} GB/s = {gbps / res['copy']['p2p']['GBps']:.0%} of p2p "
              f"({res['copy']['p2p']['GBps']:.1f} GB/s)")
        warm = res["split"]["steps"][1:]
        print("split sync phases (median ms, warm): " + ", ".join(
            f"{k[:-3]} {median([s[k] for s in warm]):.2f}"
            for k in ("manifest_ms", "recv_ms", "apply_ms", "check_ms") if k in warm[0]))
    for k in ("dp1", "dp2"):
        if "steps" in res.get(k, {}):
            print(k, [(round(s["loss"], 5), round(s["grad_norm"], 4), round(s["ms"], 1))
                      for s in res[k]["steps"]])

def plot(res: dict, path: str) -> None:
    """Left: median warm step time per arm (ms). Right: ZeRO-2 step time on 1 vs 2 GPUs (ms).
    No-op without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    arms = [a for a in ("colocated", "split", "overlap") if res.get(a, {}).get("steps")]
    steps = [median([s["step_ms"] for s in res[a]["steps"][1:]]) for a in arms]
    left.bar(arms, steps, color=["tab:gray", "tab:blue", "tab:green"][: len(arms)])
    for x, y in enumerate(steps):
        left.text(x, y, f"{y:.0f}", ha="center", va="bottom")
    left.set_ylabel("RL step, ms (median of warm steps)")
    left.set_title("GRPO step: 1 GPU colocated vs 2 GPUs split", fontsize=10)
    dp = [k for k in ("dp1", "dp2") if res.get(k, {}).get("steps")]
    times = [median([s["ms"] for s in res[k]["steps"][1:]]) for k in dp]
    right.bar([f"{res[k]['world']} GPU" for k in dp], times, color="tab:purple")
    for x, y in enumerate(times):
        right.text(x, y, f"{y:.0f}", ha="center", va="bottom")
    right.set_ylabel("train step, ms (median)")
    right.set_title("ZeRO-2 data parallel, same global batch", fontsize=10)
    env, shape = res["env"], res["shape"]
    fig.suptitle(f"{res['model']} bf16 · {shape['prompts']}x{shape['G']} P{shape['P']} "
                 f"new {shape['new']} · {env['gpu']} x2 · torch {env['torch']} · {env['date']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

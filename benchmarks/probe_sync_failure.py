"""Two GPUs, NCCL: kill or stop the sampler mid-sync, kill the trainer mid-sync, resync.

Issue 18 part 4, on the hardware (the CPU/gloo version is ``tests/sync/test_sync_failure.py``).
Processes are driven with ``torch.multiprocessing`` (no Ray); they run the engines and the
``polynya.sync`` code the Ray transport uses (``SyncGroup`` / ``send_weights`` /
``recv_weights`` / ``apply_update``). A trainer process on GPU 0 (``TrainingEngine``, ZeRO-2,
bf16, one GRPO-style step taken so its weights are not the initial ones) stays up across:

1. ``receiver_killed``: a receiver on GPU 1 ``SIGKILL``s itself when bucket 1 has arrived (before
   staging it). Time from its death to the trainer's ``SyncPeerLost``; the trainer's checksum
   and optimizer state before/after; whether its CUDA context still works (a checksum runs).
2. ``receiver_stopped``: the same with ``SIGSTOP`` (a hung sampler); the probe kills it after.
3. ``resync``: a new sampler process (version 0) joins a new group on a new port; the trainer
   sends its current weights; sampler checksum == trainer's; then ``--syncs`` more syncs
   (new versions) for the median sync time with the bounded-wait path.
4. ``sender_killed``: a second trainer process syncs version 1 to a sampler, trains a step and
   ``SIGKILL``s itself when its export reaches bucket 2 of version 2: time to the sampler's
   ``SyncPeerLost``; the sampler still serves version 1 with version 1's checksum.

    NCCL_NVLS_ENABLE=0 python benchmarks/probe_sync_failure.py --out benchmarks/results  # 2 GPUs
    python benchmarks/probe_sync_failure.py --cpu --out /tmp/probe   # dry run of the script only

Writes ``probe_sync_failure.json``; every wait here is bounded (a part that hangs is reported as
such and its processes are killed), so the probe itself always ends.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_two_gpu import _on_gpu, free_port, grpo_batch, make_prompts
from common import environment, median, save

from tests.sync.failure_peers import die, die_when_staging

MODEL = "random:qwen3-0.6b"
BUCKET = 256 << 20
WAIT_S = 150  # longest the probe waits for any one answer (a model load takes well under it)


def _state(engine) -> dict:
    """The trainer's weight checksum and a digest of its optimizer state (sums per tensor)."""
    opt = engine.engine.optimizer
    sums = [float(v.float().sum()) for s in getattr(opt, "state", {}).values()
            for v in s.values() if torch.is_tensor(v)]
    return {"checksum": engine.weight_checksum(), "optimizer": sums}


def _train_once(engine, vocab: int, seed: int) -> None:
    from polynya import Sample

    prompts = make_prompts(2, 32, vocab, seed)
    g = torch.Generator().manual_seed(seed)
    groups = [[Sample(torch.randint(10, vocab - 10, (16,), generator=g).tolist(), None, "length")
               for _ in range(4)] for _ in prompts]
    engine.forward_backward(grpo_batch(prompts, groups, logprobs=False)[0])
    engine.step()


def _place(cfg: dict, gpu: int) -> str:
    """The device of a child: GPU ``gpu`` alone, or the CPU in a ``--cpu`` dry run."""
    if cfg["device"] == "cpu":
        torch.set_num_threads(1)
        return "cpu"
    _on_gpu(gpu)
    return "cuda"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _group(cfg: dict, port: int, rank: int, device: str):
    from polynya.sync import SyncGroup

    return SyncGroup("127.0.0.1", port, rank=rank, world_size=2, device=device,
                     timeout_s=120, peer_timeout_s=cfg["peer_timeout"])


def _sampler(cfg: dict, device: str):
    from polynya.config import SamplerConfig
    from polynya.engines import SamplingEngine

    return SamplingEngine(SamplerConfig(cfg["model"], dtype="bfloat16", device=device))


def _trainer(cfg: dict, device: str):
    from polynya.config import TrainConfig
    from polynya.engines import TrainingEngine

    engine = TrainingEngine(TrainConfig(cfg["model"], dtype="bfloat16", zero_stage=2, lr=1e-5,
                                        loss="grpo", device=device))
    _train_once(engine, engine.module.config.vocab_size, seed=0)
    return engine


# ---------------------------------------------------------------- trainer on GPU 0
def trainer_main(conn, cfg: dict) -> None:
    """Answers ("sync", port, version) with what happened; ("stop", None, None) ends it."""
    device = _place(cfg, 0)
    try:
        from polynya.sync import SyncPeerLost, build_manifest, send_weights

        engine = _trainer(cfg, device)
        conn.send(("ready", None))
        group, group_port = None, None
        while True:
            cmd, port, version = conn.recv()
            if cmd == "stop":
                return
            manifest = build_manifest(engine, version=version, bucket_bytes=cfg["bucket"])
            conn.send(("manifest", manifest))
            before = _state(engine)
            if port != group_port:  # a new group (new rendezvous) per port
                group, group_port = _group(cfg, port, 0, device), port
            out: dict = {"buckets": len(manifest.buckets), "bytes": manifest.nbytes}
            t0 = time.perf_counter()
            try:
                send_weights(group, engine, manifest, cfg["bucket"])
                out.update(ok=True, sync_ms=(time.perf_counter() - t0) * 1e3)
            except SyncPeerLost as exc:
                out.update(ok=False, t_error=time.time(), error=str(exc), ranks=list(exc.ranks),
                           bucket=exc.bucket, version=exc.version)
            after = _state(engine)  # also proves the CUDA context still works
            _sync(device)
            out.update(state_unchanged=after == before, checksum=after["checksum"])
            conn.send(("sent", out))
    except Exception:
        conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------- receivers on GPU 1
def receiver_main(conn, cfg: dict, port: int, manifests: int, die_at: int | None,
                  how: str) -> None:
    """Join as rank 1; die at bucket ``die_at``, or receive ``manifests`` syncs (each manifest
    comes over ``conn``) into a fresh sampler and report ``(version, checksum, ms)`` each."""
    device = _place(cfg, 1)
    try:
        from polynya.sync import apply_update, recv_weights

        engine = None
        if die_at is None:
            engine = _sampler(cfg, device)
        else:
            die_when_staging(die_at, conn, how)
        group = _group(cfg, port, 1, device)
        conn.send(("ready", None))
        for _ in range(manifests):
            manifest = conn.recv()
            t0 = time.perf_counter()
            version = apply_update(engine, recv_weights(group, manifest, device))
            _sync(device)
            conn.send(("synced", (version, engine.weight_checksum(),
                                  (time.perf_counter() - t0) * 1e3)))
        group.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def sender_dies_main(conn, cfg: dict, port: int) -> None:
    """A second trainer: sync version 1, train a step, die at bucket 2 of version 2."""
    device = _place(cfg, 0)
    try:
        from polynya.sync import build_manifest, send_weights

        engine = _trainer(cfg, device)
        group = _group(cfg, port, 0, device)
        first = build_manifest(engine, version=1, bucket_bytes=cfg["bucket"])
        conn.send(("manifest", first))
        send_weights(group, engine, first, cfg["bucket"])
        _train_once(engine, engine.module.config.vocab_size, seed=1)
        second = build_manifest(engine, version=2, bucket_bytes=cfg["bucket"])
        conn.send(("manifest", second))
        export = engine.export_weights

        def export_or_die(bucket_bytes):
            for i, piece in enumerate(export(bucket_bytes)):
                if i == 2:
                    die(conn, "kill")
                yield piece

        engine.export_weights = export_or_die  # this process only
        send_weights(group, engine, second, cfg["bucket"])
        conn.send(("error", "the sender finished a sync it should have died in"))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def keeper_main(conn, cfg: dict, port: int) -> None:
    """The sampler of part 4: takes version 1, then must refuse version 2 (sender dies)."""
    device = _place(cfg, 1)
    try:
        from polynya.sync import SyncPeerLost, apply_update, recv_weights

        engine = _sampler(cfg, device)
        group = _group(cfg, port, 1, device)
        first = conn.recv()
        apply_update(engine, recv_weights(group, first, device))
        second = conn.recv()
        out: dict = {"version_1_checksum_ok": engine.weight_checksum() == first.checksum}
        try:
            recv_weights(group, second, device)
            out.update(ok=True)
        except SyncPeerLost as exc:
            out.update(ok=False, t_error=time.time(), error=str(exc), ranks=list(exc.ranks),
                       bucket=exc.bucket)
        _sync(device)
        out.update(version=engine.stats()["weight_version"],
                   kept_version_1=engine.weight_checksum() == first.checksum)
        conn.send(("kept", out))
    except Exception:
        conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------- orchestration (no CUDA)
class Peer:
    """A child process and its pipe; every read is bounded by ``WAIT_S``."""

    def __init__(self, ctx, target, *args):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()

    def expect(self, tag: str, wait_s: float = WAIT_S):
        if not self.conn.poll(wait_s):
            raise TimeoutError(f"no {tag!r} within {wait_s} s (hung)")
        got, value = self.conn.recv()
        if got != tag:
            raise RuntimeError(f"expected {tag!r}, got {got!r}: {value}")
        return value

    def kill(self) -> int | None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(30)
        return self.proc.exitcode


def lose_receiver(ctx, trainer: Peer, cfg: dict, how: str) -> dict:
    port = free_port()
    trainer.conn.send(("sync", port, 1))
    manifest = trainer.expect("manifest")
    peer = Peer(ctx, receiver_main, cfg, port, 1, 1, how)
    try:
        peer.expect("ready")
        peer.conn.send(manifest)
        died_at = peer.expect("dying")
        out = trainer.expect("sent")
        out["time_to_error_s"] = out.pop("t_error", float("nan")) - died_at
        out["bound_s"] = cfg["peer_timeout"]
        return out
    finally:
        out_code = peer.kill()
        print(f"{how}: receiver exit code {out_code}", flush=True)


def resync(ctx, trainer: Peer, cfg: dict, syncs: int) -> dict:
    port = free_port()
    peer = Peer(ctx, receiver_main, cfg, port, 1 + syncs, None, "")
    rows = []
    try:
        for version in range(1, 2 + syncs):
            trainer.conn.send(("sync", port, version))
            manifest = trainer.expect("manifest")
            if version == 1:
                peer.expect("ready")
            peer.conn.send(manifest)
            sent = trainer.expect("sent")
            got_version, checksum, recv_ms = peer.expect("synced")
            rows.append({"version": got_version, "verified": checksum == sent["checksum"],
                         "sync_ms": sent.get("sync_ms"), "recv_apply_ms": recv_ms})
    finally:
        peer.proc.join(60)
        peer.kill()
    warm = [r["sync_ms"] for r in rows[1:] if r["sync_ms"] is not None]
    return {"syncs": rows, "all_verified": all(r["verified"] for r in rows),
            "median_warm_sync_ms": median(warm) if warm else None}


def lose_sender(ctx, cfg: dict) -> dict:
    port = free_port()
    sender = Peer(ctx, sender_dies_main, cfg, port)
    keeper = Peer(ctx, keeper_main, cfg, port)
    try:
        keeper.conn.send(sender.expect("manifest"))
        keeper.conn.send(sender.expect("manifest"))
        died_at = sender.expect("dying")
        out = keeper.expect("kept")
        out["time_to_error_s"] = out.pop("t_error", float("nan")) - died_at
        out["bound_s"] = cfg["peer_timeout"]
        return out
    finally:
        sender.kill()
        keeper.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--peer-timeout", type=float, default=5.0)
    ap.add_argument("--syncs", type=int, default=5, help="extra syncs after the resync (timing)")
    ap.add_argument("--cpu", action="store_true",
                    help="dry run of the same script on the CPU (gloo, tiny model): not a result")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit("probe_sync_failure needs 2 GPUs (or --cpu for a dry run)")
    cfg = {"model": "tiny:qwen3" if args.cpu and args.model == MODEL else args.model,
           "device": "cpu" if args.cpu else "cuda", "peer_timeout": args.peer_timeout,
           "bucket": (1 << 15) if args.cpu else BUCKET}
    ctx = mp.get_context("spawn")
    res: dict = {"env": environment(), **cfg}
    trainer = Peer(ctx, trainer_main, cfg)
    try:
        trainer.expect("ready")
        for name, fn in (("receiver_killed", lambda: lose_receiver(ctx, trainer, cfg, "kill")),
                         ("receiver_stopped", lambda: lose_receiver(ctx, trainer, cfg, "stop")),
                         ("resync", lambda: resync(ctx, trainer, cfg, args.syncs))):
            res[name] = _part(name, fn)
            save(res, args.out, "probe_sync_failure")
            if "hung" in res[name].get("error", "") or not trainer.proc.is_alive():
                res["skipped"] = f"the trainer process hung or died in {name}: later parts on it"
                break
    finally:
        if trainer.proc.is_alive():
            trainer.conn.send(("stop", None, None))
            trainer.proc.join(30)
        trainer.kill()
    res["sender_killed"] = _part("sender_killed", lambda: lose_sender(ctx, cfg))
    save(res, args.out, "probe_sync_failure")
    report(res)


def _part(name: str, fn) -> dict:
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # keep what the other parts measured
        out = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
    out["wall_s"] = time.perf_counter() - t0
    print(f"{name}: {out}", flush=True)
    return out


def report(res: dict) -> None:
    for name in ("receiver_killed", "receiver_stopped", "sender_killed"):
        r = res.get(name, {})
        print(f"{name}: error raised={r.get('ok') is False} time-to-error "
              f"{r.get('time_to_error_s', float('nan')):.2f} s (peer_timeout {res['peer_timeout']} s)"
              f" ranks={r.get('ranks')} bucket={r.get('bucket')} "
              f"state kept={r.get('state_unchanged', r.get('kept_version_1'))}")
    r = res.get("resync", {})
    print(f"resync: verified={r.get('all_verified')} median warm sync "
          f"{r.get('median_warm_sync_ms')} ms")


if __name__ == "__main__":
    main()

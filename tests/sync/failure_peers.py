"""Peer processes for ``test_sync_failure.py``: a receiver or a trainer that joins a CPU (gloo)
``SyncGroup`` and, when told to, kills (``SIGKILL``) or stops (``SIGSTOP``) itself at a fixed
point of a sync — a receiver once bucket ``die_at``'s broadcast has arrived and before it is
staged (it never confirms), a trainer when its export is asked for bucket ``die_at`` — so the
failure always lands mid-sync. Each sends ``("dying", time.time())`` just before, so the test
measures time-to-error from the moment of death.
"""

from __future__ import annotations

import os
import signal
import time

MODEL = "tiny:qwen3"


def die(conn, how: str) -> None:
    conn.send(("dying", time.time()))
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def die_when_staging(bucket: int, conn, how: str) -> None:
    """Make this process die (``how``: "kill" / "stop") when a receive is about to stage bucket
    ``bucket`` (its broadcast has arrived; it never confirms). Patches ``StagedUpdate.put`` for
    this process only (also used by ``benchmarks/probe_sync_failure.py``)."""
    from polynya.sync import StagedUpdate

    put = StagedUpdate.put

    def put_or_die(self, index, flat):
        if index == bucket:
            die(conn, how)
        put(self, index, flat)

    StagedUpdate.put = put_or_die


def receiver(conn, port: int, world: int, rank: int, manifest, peer_timeout_s: float,
             die_at: int | None = None, how: str = "kill") -> None:
    """Join as ``rank``; die at bucket ``die_at``, or receive ``manifest`` into a fresh native
    sampler and report ``(version, checksum)``."""
    from polynya.config import SamplerConfig
    from polynya.engines import SamplingEngine
    from polynya.sync import SyncGroup, apply_update, recv_weights

    engine = None
    if die_at is None:
        engine = SamplingEngine(SamplerConfig(MODEL, dtype="float32", device="cpu",
                                              num_blocks=32, block_size=8))
    else:
        die_when_staging(die_at, conn, how)
    group = SyncGroup("127.0.0.1", port, rank=rank, world_size=world, device="cpu",
                      timeout_s=60, peer_timeout_s=peer_timeout_s)
    staged = recv_weights(group, manifest, "cpu")
    version = apply_update(engine, staged)
    conn.send(("synced", (version, engine.weight_checksum())))
    group.close()


def trainer(conn, port: int, peer_timeout_s: float, bucket_bytes: int, die_at: int) -> None:
    """Rank 0 of a group of 2: send version 1, train one step, then send version 2 and die when
    the export reaches bucket ``die_at``. Sends each manifest before sending its weights."""
    import torch
    from polynya import RolloutBatch
    from polynya.config import TrainConfig
    from polynya.engines import TrainingEngine
    from polynya.sync import SyncGroup, build_manifest, send_weights

    engine = TrainingEngine(TrainConfig(MODEL, dtype="float32", zero_stage=0, lr=5e-2))
    group = SyncGroup("127.0.0.1", port, rank=0, world_size=2, device="cpu",
                      timeout_s=60, peer_timeout_s=peer_timeout_s)
    first = build_manifest(engine, version=1, bucket_bytes=bucket_bytes)
    conn.send(("manifest", first))
    send_weights(group, engine, first, bucket_bytes)
    g = torch.Generator().manual_seed(1)
    batch = RolloutBatch([[5, 6, 7, 8]] * 2, [torch.randint(2, 500, (6,), generator=g).tolist()
                                              for _ in range(2)], advantages=[1.0, -1.0])
    engine.forward_backward(batch)
    engine.step()
    second = build_manifest(engine, version=2, bucket_bytes=bucket_bytes)
    conn.send(("manifest", second))
    export = engine.export_weights

    def export_or_die(bucket_bytes):
        for i, piece in enumerate(export(bucket_bytes)):
            if i == die_at:
                die(conn, "kill")
            yield piece

    engine.export_weights = export_or_die  # this process only
    send_weights(group, engine, second, bucket_bytes)
    raise AssertionError("the trainer should have died mid-sync")

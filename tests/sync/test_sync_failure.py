"""Broadcast sync failure (issue 18 part 4, CPU / gloo): a receiver killed (``SIGKILL``) or
stopped (``SIGSTOP``) mid-sync makes every other member raise ``SyncPeerLost`` naming it within
``peer_timeout_s`` + slack, never a hang; the trainer's weights and optimizer state are
unchanged and the other receivers keep their previous version (a partial update is never
returned); a restarted receiver joins a new group and gets the trainer's current weights,
checksum-verified. A sender killed mid-sync: the receiver errors within the bound and keeps
its previous weights and version.

Peers run in separate processes (``failure_peers``, started from a forkserver that has
imported polynya once); the kill point is fixed (a bucket index), not a race.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
from polynya import SamplingParams
from polynya.distributed import free_port
from polynya.sync import (
    SyncError,
    SyncGroup,
    SyncPeerLost,
    apply_update,
    build_manifest,
    recv_weights,
    send_weights,
)

from . import failure_peers as peers
from .test_sync import BUCKET, make_sampler, trainer

PEER_TIMEOUT = 2.0  # heartbeat every 0.4 s
SLACK = 2.5  # a loaded 2-core CI machine
VERSION = 5


@pytest.fixture(scope="module")
def ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["deepspeed", "polynya.engines", "polynya.sync", peers.__name__])
    return ctx


def start(ctx, target, *args):
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, *args), daemon=True)
    proc.start()
    return proc, here


def trainer_state(t) -> dict:
    """Weights checksum and every optimizer state tensor / step of ``t``."""
    opt = t.engine.optimizer
    state = {(i, k): (v.clone() if torch.is_tensor(v) else v)
             for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    return {"checksum": t.weight_checksum(), "state": state}


def assert_same_state(a: dict, b: dict) -> None:
    assert a["checksum"] == b["checksum"]
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for k, v in a["state"].items():
        assert torch.equal(v, b["state"][k]) if torch.is_tensor(v) else v == b["state"][k], k


def greedy(sampler) -> list[int]:
    out = sampler.generate([[17, 3, 99, 250]], SamplingParams(temperature=0, max_tokens=6))
    return out[0][0].token_ids


def in_thread(fn, *args):
    """Run ``fn`` in a thread; returns a dict that gets ``result`` / ``error`` / ``at``."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc
        box["at"] = time.time()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    box["thread"] = thread
    return box


def group(port, rank, world):
    return SyncGroup("127.0.0.1", port, rank=rank, world_size=world, device="cpu",
                     timeout_s=60, peer_timeout_s=PEER_TIMEOUT)


def receive_into(sampler, port, rank, world, manifest):
    g = group(port, rank, world)
    try:
        return apply_update(sampler, recv_weights(g, manifest, "cpu"))
    finally:
        g.close()


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_receiver_lost_mid_sync_then_restarted_receiver_resyncs(ctx, trainer, how):
    """Trainer (rank 0) + an in-process sampler (rank 1) + a receiver process (rank 2) that
    dies / stops when bucket 1 arrives; then (kill) a new receiver process and the sampler
    join a new group and take the trainer's current weights."""
    manifest = build_manifest(trainer, version=VERSION, bucket_bytes=BUCKET)
    assert len(manifest.buckets) > 3
    before = trainer_state(trainer)
    sampler = make_sampler()
    kept, kept_tokens = sampler.weight_checksum(), greedy(sampler)
    port = free_port()
    proc, conn = start(ctx, peers.receiver, port, 3, 2, manifest, PEER_TIMEOUT, 1, how)
    other = in_thread(receive_into, sampler, port, 1, 3, manifest)
    sender = group(port, 0, 3)
    try:
        with pytest.raises(SyncPeerLost) as lost:
            send_weights(sender, trainer, manifest, BUCKET)
        failed_at = time.time()
        tag, died_at = conn.recv()
        assert tag == "dying"
        assert failed_at - died_at < PEER_TIMEOUT + SLACK, failed_at - died_at
        err = lost.value
        assert err.ranks == (2,) and err.version == VERSION
        assert isinstance(err, SyncError)
        msg = str(err)
        assert f"version {VERSION}" in msg and "rank(s) [2]" in msg and "new port" in msg
        if how == "stop":
            assert "no heartbeat" in msg
        # the other receiver: a bounded error too, nothing applied
        other["thread"].join(PEER_TIMEOUT + SLACK)
        assert not other["thread"].is_alive()
        assert isinstance(other.get("error"), SyncPeerLost), other
        assert other["at"] - died_at < PEER_TIMEOUT + SLACK
        assert sampler.stats()["weight_version"] == 0 and sampler.weight_checksum() == kept
        assert greedy(sampler) == kept_tokens
        # the trainer: untouched; the torn-down group refuses to be used again
        assert_same_state(trainer_state(trainer), before)
        with pytest.raises(SyncError, match="torn down"):
            send_weights(sender, trainer, manifest, BUCKET)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    if how == "stop":
        return  # the restart below is the same after either failure: run it once

    # a restarted receiver (new process) and the surviving sampler join a new group
    port = free_port()
    proc, conn = start(ctx, peers.receiver, port, 3, 2, manifest, PEER_TIMEOUT)
    other = in_thread(receive_into, sampler, port, 1, 3, manifest)
    sender = group(port, 0, 3)
    assert send_weights(sender, trainer, manifest, BUCKET) == manifest.nbytes
    sender.close()
    tag, (version, checksum) = conn.recv()
    proc.join(30)
    other["thread"].join(30)
    assert "error" not in other, other
    assert tag == "synced" and version == VERSION == other["result"]
    assert checksum == trainer.weight_checksum() == manifest.checksum == sampler.weight_checksum()
    assert proc.exitcode == 0


def test_sender_killed_mid_sync_receiver_keeps_its_version(ctx):
    """A trainer process syncs version 1, trains, then dies while sending version 2 (when its
    export reaches bucket 2): the receiver errors within the bound and still serves version 1."""
    port = free_port()
    proc, conn = start(ctx, peers.trainer, port, PEER_TIMEOUT, BUCKET, 2)
    sampler = make_sampler()
    g = group(port, 1, 2)
    try:
        tag, first = conn.recv()
        assert apply_update(sampler, recv_weights(g, first, "cpu")) == 1
        assert sampler.weight_checksum() == first.checksum
        tokens = greedy(sampler)
        tag, second = conn.recv()
        assert second.checksum != first.checksum and len(second.buckets) > 3
        with pytest.raises(SyncPeerLost) as lost:
            recv_weights(g, second, "cpu")
        failed_at = time.time()
        tag, died_at = conn.recv()
        assert tag == "dying"
        assert failed_at - died_at < PEER_TIMEOUT + SLACK, failed_at - died_at
        err = lost.value
        assert err.ranks == (0,) and err.version == 2 and err.bucket in (1, 2)
        assert "keeps its previous weights and version" in str(err)
        assert sampler.stats()["weight_version"] == 1
        assert sampler.weight_checksum() == first.checksum
        assert greedy(sampler) == tokens
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL


def test_receiver_that_cannot_stage_keeps_the_group_in_step(trainer, monkeypatch):
    """A receiver failing locally (out of memory while staging bucket 2) still confirms: the
    sender gets a ``SyncError`` naming it (not a lost peer), nothing is applied, and the same
    group then carries the next sync."""
    from polynya.sync import StagedUpdate

    manifest = build_manifest(trainer, version=VERSION, bucket_bytes=BUCKET)
    sampler = make_sampler()
    kept = sampler.weight_checksum()
    put, failures = StagedUpdate.put, []

    def put_once_oom(self, index, flat):
        if index == 2 and not failures:
            failures.append(index)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        put(self, index, flat)

    monkeypatch.setattr(StagedUpdate, "put", put_once_oom)
    port = free_port()
    box: dict = {}

    def receiver():
        g = group(port, 1, 2)
        for attempt in range(2):
            try:
                box[attempt] = apply_update(sampler, recv_weights(g, manifest, "cpu"))
            except Exception as exc:
                box[attempt] = exc
        g.close()

    thread = threading.Thread(target=receiver, daemon=True)
    thread.start()
    sender = group(port, 0, 2)
    with pytest.raises(SyncError, match=r"rank\(s\) \[1\] could not take version 5") as err:
        send_weights(sender, trainer, manifest, BUCKET)
    assert not isinstance(err.value, SyncPeerLost)
    assert send_weights(sender, trainer, manifest, BUCKET) == manifest.nbytes  # same group
    sender.close()
    thread.join(30)
    assert isinstance(box[0], SyncError) and "out of memory" in str(box[0])
    assert box[1] == VERSION and sampler.weight_checksum() == trainer.weight_checksum() != kept


def test_member_alive_but_absent_times_out_and_errors_pickle(trainer):
    """A member that beats but never enters the sync: the sender gives up after ``timeout_s``
    (no peer named). ``SyncPeerLost`` survives pickling (Ray carries it to the driver)."""
    import pickle

    manifest = build_manifest(trainer, version=VERSION, bucket_bytes=BUCKET)
    port = free_port()
    members = {}
    joined = threading.Thread(target=lambda: members.setdefault(
        1, SyncGroup("127.0.0.1", port, rank=1, world_size=2, device="cpu", timeout_s=1.5,
                     peer_timeout_s=PEER_TIMEOUT)), daemon=True)
    joined.start()
    sender = SyncGroup("127.0.0.1", port, rank=0, world_size=2, device="cpu", timeout_s=1.5,
                       peer_timeout_s=PEER_TIMEOUT)
    joined.join(30)
    t0 = time.monotonic()
    with pytest.raises(SyncPeerLost, match="made no progress for 1.5 s") as err:
        send_weights(sender, trainer, manifest, BUCKET)
    assert time.monotonic() - t0 < 1.5 + SLACK
    assert err.value.ranks == () and err.value.version == VERSION
    back = pickle.loads(pickle.dumps(err.value))
    assert isinstance(back, SyncPeerLost) and str(back) == str(err.value)
    assert (back.ranks, back.version, back.bucket) == (err.value.ranks, VERSION, err.value.bucket)
    members[1].close()

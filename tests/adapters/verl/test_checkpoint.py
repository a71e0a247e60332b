"""The ``polynya`` checkpoint engine moves weights between two gloo processes, verified.

The sender (``ckpt_sender.py``, actor rank 0) streams a random bf16 model in 64 KiB buckets, twice;
this process (the rollout rank) receives them. Sync 1: received tensors equal the model's bit for
bit and both sides report the same checksum (``polynya.distributed.checksum_named_tensors``).
Sync 2 has a value altered on the wire: ``SyncError`` before a single tensor is handed out.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from polynya.adapters.verl.checkpoint import PolynyaCheckpointEngine
from polynya.checksum import checksum_named_tensors
from polynya.models import load_model
from polynya.sync import SyncError, SyncPeerLost

SENDER = Path(__file__).with_name("ckpt_sender.py")
ROOT = Path(__file__).resolve().parents[3]


def topology():
    master = PolynyaCheckpointEngine(bucket_size=1 << 16, is_master=True, device="cpu", host="127.0.0.1")
    meta = [master.prepare(), {}]  # actor rank 0, actor rank 1
    actor, rollout = PolynyaCheckpointEngine.build_topology(2, 1, meta)
    assert actor["rank"] == [0, -1] and rollout["rank"] == [1] and rollout["world_size"] == [2]
    return rollout["master"][0]


async def collect(engine):
    return [(n, t.clone()) async for n, t in engine.receive_weights(global_steps=5)]


def test_weights_arrive_exactly_then_a_corrupted_bucket_is_rejected():
    master = topology()
    sender = subprocess.Popen([sys.executable, str(SENDER), "--master", json.dumps(master)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    receiver = PolynyaCheckpointEngine(bucket_size=1 << 16, device="cpu")
    try:
        receiver.init_process_group(rank=1, world_size=2, master=master)
        got = asyncio.run(collect(receiver))  # sync 1: intact
        good = receiver.last_checksum
        with pytest.raises(SyncError, match="checksum mismatch"):  # sync 2: one value flipped
            asyncio.run(collect(receiver))
    finally:
        out, err = sender.communicate(timeout=300)
        receiver.finalize()
    assert sender.returncode == 0, err[-2000:]
    sent = [line.split()[1] for line in out.splitlines() if line.startswith("SENT ")]

    model = load_model("tiny:qwen3", dtype="bfloat16", device="cpu", seed=7)
    want = dict(model.named_parameters())
    assert [n for n, _ in got] == list(want)
    for name, t in got:
        assert t.dtype == want[name].dtype and t.shape == want[name].shape
        assert bool((t == want[name].detach()).all()), name
    checksum = checksum_named_tensors((n, p.detach()) for n, p in want.items())
    assert sent == [checksum, checksum] and good == checksum
    assert receiver.last_checksum == checksum  # the rejected sync did not count


def test_receive_needs_a_rollout_rank():
    engine = PolynyaCheckpointEngine(bucket_size=1024, device="cpu")
    with pytest.raises(RuntimeError, match="rollout rank"):
        asyncio.run(collect(engine))
    with pytest.raises(ValueError, match="bucket_size"):
        PolynyaCheckpointEngine(bucket_size=0)
    for bad in (0, -1.0, float("nan"), "30", True):
        with pytest.raises(ValueError, match="peer_timeout_s"):
            PolynyaCheckpointEngine(bucket_size=1024, peer_timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s"):
        PolynyaCheckpointEngine(bucket_size=1024, timeout_s=0)


def _dying_peer(role: str, master: dict) -> subprocess.Popen:
    script = Path(__file__).with_name("ckpt_dying_peer.py")
    return subprocess.Popen([sys.executable, str(script), "--master", json.dumps(master), "--role", role],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_sender_killed_mid_sync_ends_the_receive_within_the_bound():
    master = topology()
    sender = _dying_peer("sender", master)
    receiver = PolynyaCheckpointEngine(bucket_size=1 << 16, device="cpu", peer_timeout_s=2.0)
    try:
        receiver.init_process_group(rank=1, world_size=2, master=master)
        start = time.monotonic()
        with pytest.raises(SyncPeerLost, match=r"\(receiving\).*rank\(s\) \[0\]") as info:
            asyncio.run(collect(receiver))
        assert time.monotonic() - start < 60.0 + 2.0 + 15.0  # the sender's start-up + the bound
        assert sender.wait(timeout=60) == 9  # it died after its first bucket, mid-sync
        assert info.value.ranks == (0,) and info.value.version == 5
        assert receiver.last_checksum is None  # nothing was handed out
        with pytest.raises(SyncError):  # the group is torn down, not reusable
            asyncio.run(collect(receiver))
    finally:
        sender.kill()
        receiver.finalize()


def test_receiver_killed_mid_sync_ends_the_send_within_the_bound():
    master = topology()
    receiver = _dying_peer("receiver", master)
    sender = PolynyaCheckpointEngine(bucket_size=1 << 16, is_master=True, device="cpu", peer_timeout_s=2.0)
    model = load_model("tiny:qwen3", dtype="bfloat16", device="cpu", seed=7)
    consumed = []

    def weights():
        for n, p in model.named_parameters():
            consumed.append(n)
            yield n, p.detach()

    try:
        sender.init_process_group(rank=0, world_size=2, master=master)
        start = time.monotonic()
        with pytest.raises(SyncPeerLost, match=r"\(sending\).*rank\(s\) \[1\]"):
            asyncio.run(sender.send_weights(weights(), global_steps=5))
        assert time.monotonic() - start < 2.0 + 15.0  # peer_timeout_s + heartbeats + a loaded machine
        assert receiver.wait(timeout=60) == 9
        assert consumed == [n for n, _ in model.named_parameters()]  # the generator ran to its end
        assert sender.last_checksum is None
    finally:
        receiver.kill()
        sender.finalize()

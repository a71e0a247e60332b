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
from pathlib import Path

import pytest
from polynya.adapters.verl.checkpoint import PolynyaCheckpointEngine
from polynya.checksum import checksum_named_tensors
from polynya.models import load_model
from polynya.sync import SyncError

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

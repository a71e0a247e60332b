"""A peer of test_checkpoint that dies mid-sync (its own process): ``--role sender`` streams a
random model and ``os._exit``s after its first bucket; ``--role receiver`` receives and exits
after the first bucket arrived. Either way the other side must fail within its bound."""
from __future__ import annotations

import argparse
import asyncio
import json
import os

from polynya.adapters.verl.checkpoint import PolynyaCheckpointEngine
from polynya.models import load_model


class DyingSender(PolynyaCheckpointEngine):
    def _send_bucket(self, items):
        super()._send_bucket(items)
        os._exit(9)  # after the first bucket: mid-sync for the receiver


class DyingReceiver(PolynyaCheckpointEngine):
    def _broadcast(self, tensor):
        super()._broadcast(tensor)
        if tensor.numel() > 1024:  # a bucket (headers are small)
            os._exit(9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master")
    ap.add_argument("--role", choices=("sender", "receiver"))
    args = ap.parse_args()
    master = json.loads(args.master)
    if args.role == "sender":
        engine = DyingSender(bucket_size=1 << 16, is_master=True, device="cpu", peer_timeout_s=2.0)
        engine.init_process_group(rank=0, world_size=2, master=master)
        model = load_model("tiny:qwen3", dtype="bfloat16", device="cpu", seed=7)
        asyncio.run(engine.send_weights(((n, p.detach()) for n, p in model.named_parameters()), global_steps=5))
    else:
        engine = DyingReceiver(bucket_size=1 << 16, device="cpu", peer_timeout_s=2.0)
        engine.init_process_group(rank=1, world_size=2, master=master)

        async def drain():
            return [n async for n, _ in engine.receive_weights(global_steps=5)]

        asyncio.run(drain())


if __name__ == "__main__":
    main()

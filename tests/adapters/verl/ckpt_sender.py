"""Sender side of test_checkpoint (its own process): actor rank 0 of a polynya checkpoint engine
streams a random model's weights twice over one group: intact, then with one value of the first
bucket flipped after it was signed."""
from __future__ import annotations

import argparse
import asyncio
import json

from polynya.adapters.verl.checkpoint import PolynyaCheckpointEngine
from polynya.models import load_model


class Corrupting(PolynyaCheckpointEngine):
    """Alters the bytes of the first bucket on the wire (the checksum was taken before)."""

    corrupt = False

    def _send_bucket(self, items):
        if self.corrupt:
            self.corrupt = False
            items = [(n, t.clone()) for n, t in items]
            items[0][1].view(-1)[0] += 1.0
        super()._send_bucket(items)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master")
    args = ap.parse_args()
    engine = Corrupting(bucket_size=1 << 16, is_master=True, device="cpu")
    engine.init_process_group(rank=0, world_size=2, master=json.loads(args.master))
    model = load_model("tiny:qwen3", dtype="bfloat16", device="cpu", seed=7)
    for corrupt in (False, True):
        engine.corrupt = corrupt
        asyncio.run(engine.send_weights(((n, p.detach()) for n, p in model.named_parameters()), global_steps=5))
        print("SENT " + engine.last_checksum, flush=True)
    engine.finalize()


if __name__ == "__main__":
    main()

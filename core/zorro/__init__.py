"""ZoRRo Train: run each shared prefix once, with every response packed behind it.

``tree`` finds what a batch shares (a prefix forest), ``batching`` cuts batches into parts of
whole prompt groups (rows, micro-batches, data-parallel shards), ``pack`` lays a part out in
rows with true RoPE positions, ``attention`` hooks the visibility rule into
any HF decoder. ``polynya.compute_logprobs(model, batch, zorro=True)`` ties them together.
"""
from .batching import plan_micro_batches, prompt_groups, split_batch
from .pack import PackedRows, pack_rows
from .tree import Forest, build_forest

__all__ = ["Forest", "build_forest", "PackedRows", "pack_rows", "plan_micro_batches", "prompt_groups",
           "split_batch"]

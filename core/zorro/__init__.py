"""ZoRRo Train: run each shared prefix once, with every response packed behind it.

``tree`` finds what a batch shares (a prefix forest), ``pack`` lays it out in rows with true
RoPE positions and cuts batches by whole groups, ``attention`` hooks the visibility rule into
any HF decoder. ``polynya.compute_logprobs(model, batch, zorro=True)`` ties them together.
"""
from .pack import PackedRows, pack_rows, split_batch
from .tree import Forest, build_forest

__all__ = ["Forest", "build_forest", "PackedRows", "pack_rows", "split_batch"]

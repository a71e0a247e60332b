"""Synthetic paged KV layouts with shared prefixes, laid out the way a prefix cache does it.

Used by the FCA tests and ``benchmarks/bench_fca.py``; ``plan_difference`` compares two plans'
work lists (the Triton planner against the torch one). A forest is given level by level as
``(fanout, tokens)``: ``[(8, 4096), (16, 512)]`` is 8 prompts of 4096 tokens with 16 samples of
512 tokens each; ``[(1, 2048), (64, 512), (8, 512)]`` a system prompt shared by 64 prompts
with 8 samples each. ``tokens`` may be ``(lo, hi)`` for ragged lengths (drawn per node). Full
blocks of a node are shared by its whole subtree; a node's partial last block is copied into
each child (copy-on-write), so only full blocks are ever shared::

    bt, seq_lens, num_blocks = build_forest([(8, 4096), (16, 512)], block_size=16)
"""
from __future__ import annotations

import random

import torch

Level = tuple[int, "int | tuple[int, int]"]


def build_forest(levels: list[Level], block_size: int, *, seed: int = 0, shuffle: bool = True,
                 spare_blocks: int = 3, device: str | torch.device = "cpu",
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables for the leaves of a forest.

    Args:
        levels: ``[(fanout, tokens), ...]`` from the roots down; leaves are the requests.
        block_size: tokens per KV block.
        seed: for ragged lengths, block-id and row shuffles.
        shuffle: permute the rows (members of a group are not adjacent) and the block ids.
        spare_blocks: unused blocks added to the cache.

    Returns:
        ``block_tables [B, max_blocks]`` int32 (-1 padded), ``seq_lens [B]`` int32, and the
        number of blocks the cache needs.
    """
    rng = random.Random(seed)
    rows: list[list[int]] = []
    lens: list[int] = []
    counter = [0]

    def new_ids(n: int) -> list[int]:
        out = list(range(counter[0], counter[0] + n))
        counter[0] += n
        return out

    def draw(tokens) -> int:
        return rng.randint(*tokens) if isinstance(tokens, tuple) else int(tokens)

    def grow(depth: int, ids: list[int], carry: int, total: int) -> None:
        fanout, tokens = levels[depth]
        for _ in range(fanout):
            own = draw(tokens)
            n = carry + own
            if depth == len(levels) - 1:
                rows.append(ids + new_ids(-(-n // block_size)))
                lens.append(total + own)
            else:
                grow(depth + 1, ids + new_ids(n // block_size), n % block_size, total + own)

    grow(0, [], 0, 0)
    num_blocks = counter[0] + spare_blocks
    perm = list(range(num_blocks))
    order = list(range(len(rows)))
    if shuffle:
        rng.shuffle(perm)
        rng.shuffle(order)
    width = max(len(r) for r in rows)
    bt = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(order):
        bt[i, :len(rows[r])] = torch.tensor([perm[x] for x in rows[r]], dtype=torch.int32)
    seq_lens = torch.tensor([lens[r] for r in order], dtype=torch.int32)
    return bt.to(device), seq_lens.to(device), num_blocks


def random_kv(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype,
              device, generator: torch.Generator | None = None):
    """Fresh random caches ``[num_blocks, block_size, hkv, d]`` (never zeros)."""
    k = torch.randn(num_blocks, block_size, hkv, d, device=device, generator=generator)
    v = torch.randn(num_blocks, block_size, hkv, d, device=device, generator=generator)
    return k.to(dtype), v.to(dtype)


def plan_difference(want, got) -> str | None:
    """The first work-list field (``ForestPlan.work_tensors`` order) in which plan ``got``
    differs from ``want``, with both values, or None when they are equal. Shared-item entries
    past ``want.n_shared`` (and the dump slot) are scratch and not compared."""
    from .plan import WORK_FIELDS

    n = int(want.n_shared.item())
    for name in WORK_FIELDS:
        cut = slice(0, n) if name.startswith("sh_") else slice(None)
        a, b = getattr(want, name).cpu()[cut], getattr(got, name).cpu()[cut]
        if not torch.equal(a, b):
            return f"{name}: {a.tolist()} != {b.tolist()}"
    return None

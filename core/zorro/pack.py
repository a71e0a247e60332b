"""Pack a batch's prefix forest into rows for one forward pass, and split batches by group.

A *unit* is what may never be split: a tree of the forest (samples that share tokens) merged
with every sample of the same ``group_id``. Units are packed first-fit-decreasing into rows of
at most ``max_tokens_per_row`` deduplicated tokens (a unit larger than that gets a row of its
own); rows are right-padded to a common length. ``split_batch`` uses the same units to cut a
batch into micro-batches or data-parallel shards.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..types import RolloutBatch
from .tree import Forest, build_forest

PAD_TIN = np.iinfo(np.int32).max  # padding tokens see only earlier padding (never real tokens)


@dataclass
class PackedRows:
    """Model inputs of the ZoRRo layout, ``R`` rows of ``L`` tokens.

    input_ids, position_ids, tin, tout: ``[R, L]`` (int64 / int64 / int32 / int32);
    pred_index: ``[N]`` flat index into ``[R * L]`` of the position predicting each response
    token; pred_target: ``[N]`` that token; out_row, out_col: ``[N]`` its place in ``[B, Rmax]``.
    nodes: host ``[num_nodes, 3]`` int64 table of the forest's nodes in flat ``[R * L]`` indices:
    ``start, end`` of the node's tokens and ``stop``, the end of its subtree (``== end`` for a
    leaf); what split attention plans from (``polynya.kernels.zorro.plan_split``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    tin: torch.Tensor
    tout: torch.Tensor
    pred_index: torch.Tensor
    pred_target: torch.Tensor
    out_row: torch.Tensor
    out_col: torch.Tensor
    num_real_tokens: int
    nodes: np.ndarray

    def to(self, device) -> "PackedRows":
        return PackedRows(*(getattr(self, f).to(device, non_blocking=True) for f in
                            ("input_ids", "position_ids", "tin", "tout", "pred_index",
                             "pred_target", "out_row", "out_col")), self.num_real_tokens, self.nodes)


def sequences(batch: RolloutBatch) -> list[np.ndarray]:
    return [np.concatenate([p, r]) for p, r in zip(batch.prompts, batch.responses)]


def units_of(batch: RolloutBatch, forest: Forest) -> list[list[int]]:
    """Sample indices grouped into units (trees merged with equal group_ids), in first-seen order."""
    n = len(batch)
    link = {}  # union-find over tree roots and group ids

    def find(x):
        while link.get(x, x) != x:
            link[x] = link.get(link[x], link[x])
            x = link[x]
        return x

    for i in range(n):
        a = find(("tree", int(forest.sample_root[i])))
        if batch.group_ids is not None:
            b = find(("group", batch.group_ids[i]))
            if a != b:
                link[b] = a
    units: dict = {}
    for i in range(n):
        units.setdefault(find(("tree", int(forest.sample_root[i]))), []).append(i)
    return list(units.values())


def _unit_tokens(unit: list[int], forest: Forest, batch: RolloutBatch, zorro: bool) -> int:
    if not zorro:
        return sum(batch.prompts[i].size + batch.responses[i].size for i in unit)
    roots = {int(forest.sample_root[i]) for i in unit}
    return int(sum(forest.node_len[forest.node_root == r].sum() for r in roots))


def _first_fit(costs: list[int], capacity: int | None) -> list[list[int]]:
    bins, loads = [], []
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        for b, load in enumerate(loads):
            if capacity is None or load + costs[k] <= capacity:
                bins[b].append(k)
                loads[b] += costs[k]
                break
        else:
            bins.append([k])
            loads.append(costs[k])
    return bins


def split_batch(batch: RolloutBatch, max_tokens: int | None = None, *, zorro: bool = True,
                num_parts: int | None = None) -> list[list[int]]:
    """Cut a batch into parts made of whole units (prompt groups).

    Args:
        max_tokens: token budget per part (deduplicated tokens when ``zorro``, else prompt +
            response tokens of every sample); a unit over budget becomes a part of its own.
        num_parts: instead of a budget, exactly this many parts balanced by tokens
            (data-parallel shards); ``ValueError`` if there are fewer units than parts.
    Returns:
        row-index lists (ascending within each part).
    """
    forest = build_forest(sequences(batch))
    units = units_of(batch, forest)
    costs = [_unit_tokens(u, forest, batch, zorro) for u in units]
    if num_parts is not None:
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, got {num_parts}")
        if len(units) < num_parts:
            raise ValueError(f"cannot split {len(units)} prompt group(s) into {num_parts} parts: "
                             "give each data-parallel rank at least one group")
        parts, loads = [[] for _ in range(num_parts)], [0] * num_parts
        for k in sorted(range(len(units)), key=lambda k: -costs[k]):
            b = loads.index(min(loads))
            parts[b].extend(units[k])
            loads[b] += costs[k]
        return [sorted(p) for p in parts]
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return [sorted(i for k in b for i in units[k]) for b in _first_fit(costs, max_tokens)]


def pack_rows(batch: RolloutBatch, *, max_tokens_per_row: int | None = None, pad_multiple: int = 1,
              pad_id: int = 0) -> PackedRows:
    """Lay the batch's prefix forest out in rows (see module docstring)."""
    forest = build_forest(sequences(batch))
    units = units_of(batch, forest)
    roots_of_unit = [sorted({int(forest.sample_root[i]) for i in u}) for u in units]
    root_span = {}  # tree root -> (start, stop) in the forest's token array (trees are contiguous)
    for r in np.flatnonzero(forest.node_parent < 0):
        stop = forest.node_tout[r]
        root_span[int(r)] = (int(forest.node_offset[r]),
                             int(forest.node_offset[stop] + forest.node_len[stop]))
    costs = [sum(root_span[r][1] - root_span[r][0] for r in rs) for rs in roots_of_unit]
    rows = _first_fit(costs, max_tokens_per_row)

    length = max(sum(costs[k] for k in b) for b in rows)
    length = -(-length // pad_multiple) * pad_multiple
    num_rows = len(rows)
    flat = np.empty(forest.num_tokens, dtype=np.int64)  # forest token -> flat index in [R * L]
    for r, b in enumerate(rows):
        cursor = 0
        for k in b:
            for root in roots_of_unit[k]:
                lo, hi = root_span[root]
                flat[lo:hi] = r * length + cursor + np.arange(hi - lo)
                cursor += hi - lo

    ids = np.full(num_rows * length, pad_id, dtype=np.int64)
    pos = np.zeros(num_rows * length, dtype=np.int64)
    tin = np.full(num_rows * length, PAD_TIN, dtype=np.int32)
    tout = np.full(num_rows * length, PAD_TIN, dtype=np.int32)
    ids[flat] = forest.tokens
    pos[flat] = forest.depth
    tin[flat] = forest.node_of
    tout[flat] = forest.node_tout[forest.node_of]

    pred, tgt, orow, ocol = [], [], [], []
    for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
        if r.size == 0:
            continue
        sp = forest.sample_pos[i]
        pred.append(flat[sp[p.size - 1: p.size - 1 + r.size]])
        tgt.append(r)
        orow.append(np.full(r.size, i))
        ocol.append(np.arange(r.size))
    cat = (lambda xs: torch.from_numpy(np.concatenate(xs)) if xs else torch.zeros(0, dtype=torch.int64))
    as2d = (lambda a: torch.from_numpy(a).view(num_rows, length))
    return PackedRows(as2d(ids), as2d(pos), as2d(tin), as2d(tout), cat(pred), cat(tgt),
                      cat(orow), cat(ocol), forest.num_tokens, _node_table(forest, flat))


def _node_table(forest: Forest, flat: np.ndarray) -> np.ndarray:
    """``[N, 3]`` start, end, stop of every node in flat indices (a tree's tokens are contiguous)."""
    start = flat[forest.node_offset]
    last = forest.node_tout
    stop = flat[forest.node_offset[last] + forest.node_len[last] - 1] + 1
    return np.stack([start, start + forest.node_len, stop], axis=1)

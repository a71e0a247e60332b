"""Lay a batch out in packed rows for one forward pass (the ZoRRo layout).

Each row holds the prefix forest (``tree.build_forest``) of some whole prompt groups: every
shared prefix once (one that different prompts start with only from ``tree.MIN_SHARED_TOKENS``
tokens: a chat template's header is repeated per prompt, cheaper than one more attention partial
for every token behind it), every response behind it, true RoPE positions. Without
``max_tokens_per_row`` the whole batch is one row; with it, the groups are cut into rows of at
most that many deduplicated tokens by ``batching.split_batch`` (a prefix shared by groups in
different rows is repeated in each row; a group over budget gets a row of its own). Rows are
right-padded to a common length.

``share=False`` gives the packed *naive* layout: the same rows, but every sample its own causal
segment (``tree.separate_forest``; its prompt repeated per sample, nothing shared), rows cut by
prompt + response tokens — what a framework's remove-padding path runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..types import RolloutBatch
from .batching import layout_forest, sequences, split_batch
from .tree import Forest, separate_forest

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

    def to(self, device) -> PackedRows:
        return PackedRows(*(getattr(self, f).to(device, non_blocking=True) for f in
                            ("input_ids", "position_ids", "tin", "tout", "pred_index",
                             "pred_target", "out_row", "out_col")), self.num_real_tokens, self.nodes)


def pack_rows(batch: RolloutBatch, *, max_tokens_per_row: int | None = None, pad_multiple: int = 1,
              pad_id: int = 0, share: bool = True) -> PackedRows:
    """Lay the batch out in rows (see module docstring): one prefix forest per row; with
    ``share=False`` one causal segment per sample (nothing shared)."""
    parts = (split_batch(batch, max_tokens_per_row, zorro=share) if max_tokens_per_row is not None
             else [list(range(len(batch)))])
    forests = [_forest(batch, part, share) for part in parts]
    length = max(f.num_tokens for f in forests)
    length = -(-length // pad_multiple) * pad_multiple
    num_rows = len(parts)
    ids = np.full(num_rows * length, pad_id, dtype=np.int64)
    pos = np.zeros(num_rows * length, dtype=np.int64)
    tin = np.full(num_rows * length, PAD_TIN, dtype=np.int32)
    tout = np.full(num_rows * length, PAD_TIN, dtype=np.int32)
    pred, tgt, orow, ocol, nodes = [], [], [], [], []
    first_node = 0  # node numbers stay unique over rows
    for r, (part, forest) in enumerate(zip(parts, forests)):
        flat = r * length + np.arange(forest.num_tokens)  # forest token -> flat index in [R * L]
        ids[flat] = forest.tokens
        pos[flat] = forest.depth
        tin[flat] = forest.node_of + first_node
        tout[flat] = forest.node_tout[forest.node_of] + first_node
        first_node += forest.node_len.size
        nodes.append(_node_table(forest, flat))
        for k, i in enumerate(part):
            p, resp = batch.prompts[i], batch.responses[i]
            if resp.size == 0:
                continue
            sp = forest.sample_pos[k]
            pred.append(flat[sp[p.size - 1: p.size - 1 + resp.size]])
            tgt.append(resp)
            orow.append(np.full(resp.size, i))
            ocol.append(np.arange(resp.size))
    cat = (lambda xs: torch.from_numpy(np.concatenate(xs)) if xs else torch.zeros(0, dtype=torch.int64))
    as2d = (lambda a: torch.from_numpy(a).view(num_rows, length))
    return PackedRows(as2d(ids), as2d(pos), as2d(tin), as2d(tout), cat(pred), cat(tgt),
                      cat(orow), cat(ocol), sum(f.num_tokens for f in forests), np.concatenate(nodes))


def _forest(batch: RolloutBatch, part: list[int], share: bool) -> Forest:
    return layout_forest(batch, part) if share else separate_forest(sequences(batch, part))


def _node_table(forest: Forest, flat: np.ndarray) -> np.ndarray:
    """``[N, 3]`` start, end, stop of every node in flat indices (a tree's tokens are contiguous)."""
    start = flat[forest.node_offset]
    last = forest.node_tout
    stop = flat[forest.node_offset[last] + forest.node_len[last] - 1] + 1
    return np.stack([start, start + forest.node_len, stop], axis=1)

"""Work plan of split ZoRRo attention for one packed batch (built once, used by every layer).

A packed ZoRRo batch is a prefix forest laid out in preorder: a node's descendants are the
tokens right after it, up to the end of its subtree. Attention over the forest splits exactly
into one dense problem per node:

* an *inner* node ``a`` (one with children): queries ``[start_a, stop_a)`` (the node and its
  whole subtree) read keys ``[start_a, end_a)`` under a *top-left* causal mask — the node's own
  tokens are causal, every descendant sees all of the node. A prompt's keys are read once for
  the prompt and its G responses, never G times;
* a *leaf* (a response): causal self-attention; all leaves run as one padded batch
  ``[leaves, L]`` (``L`` = the longest leaf rounded up to ``LEAF_MULTIPLE``; a leaf's padding
  comes after it, so causal attention never lets a real token see it).

A token thus gets one partial (output, LSE) from each inner ancestor and one from its leaf; the
combine merges them exactly by log-sum-exp. The calls' outputs are *parts* (inner calls in
order, then the leaf batch); ``src[t]`` lists where token ``t``'s partials are, packed as
``part << 32 | row``; ``kv_src[t]`` where its key/value gradient is (one source: the call of its
own node)::

    plan = plan_split(nodes, num_tokens, device)   # nodes [N, 3] = start, end, stop (flat)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_INNER = 64  # more inner nodes (deep multi-turn forests): FlexAttention is the better path
LEAF_MULTIPLE = 64  # padded leaf length: few distinct shapes (each new one builds a cuDNN graph)


@dataclass
class SplitPlan:
    """Calls and merge tables of split ZoRRo attention over ``num_tokens`` flat tokens.

    Attributes:
        inner: ``(start, end, stop)`` of every inner node, preorder (host ints).
        leaf_index: ``[leaves * leaf_len]`` int64 flat index of each slot of the padded leaf
            batch (padding slots repeat the leaf's last token); None when there are no leaves.
        leaf_valid: ``[leaves * leaf_len]`` bool, False on padding slots; leaf_len: ``L``.
        src: ``[num_tokens, K]`` int64 ``part << 32 | row`` of each partial, ``-1`` = none.
        kv_src: ``[num_tokens, 1]`` int64, the same for the key/value gradient; ``-1`` (zeros)
            for tokens outside every node (padding).
    """

    num_tokens: int
    inner: list[tuple[int, int, int]]
    leaf_index: torch.Tensor | None
    leaf_valid: torch.Tensor | None
    leaf_len: int
    src: torch.Tensor
    kv_src: torch.Tensor


def check_nodes(nodes: np.ndarray, num_tokens: int) -> None:
    """``ValueError`` unless ``nodes`` is a valid preorder node table inside ``num_tokens``."""
    if nodes.ndim != 2 or nodes.shape[1] != 3 or nodes.shape[0] == 0:
        raise ValueError(f"nodes must be a non-empty [N, 3] table (start, end, stop); got {nodes.shape}")
    start, end, stop = nodes.T
    if (start < 0).any() or (stop > num_tokens).any() or not ((start < end) & (end <= stop)).all():
        raise ValueError(f"every node needs 0 <= start < end <= stop <= {num_tokens}")
    stack = []  # open subtrees, innermost last: they must nest or be disjoint (preorder layout)
    for i in np.lexsort((-stop, start)):
        while stack and stop[stack[-1]] <= start[i]:
            stack.pop()
        if stack and (stop[i] > stop[stack[-1]] or start[i] < end[stack[-1]]):
            p = stack[-1]
            raise ValueError(f"node {i} [{start[i]}, {end[i]}, {stop[i]}) neither nests in the "
                             f"subtree of node {p} [{start[p]}, {end[p]}, {stop[p]}) nor follows it")
        stack.append(i)


def plan_split(nodes: np.ndarray, num_tokens: int, device: torch.device | str) -> SplitPlan:
    """Plan split attention for a node table ``[N, 3]`` (start, end, stop) in flat token indices.

    ``stop`` is the end of the node's subtree (``== end`` for a leaf); subtrees nest or are
    disjoint and a node's own tokens hold no other node (preorder layout), else ``ValueError``.
    """
    nodes = np.asarray(nodes, dtype=np.int64)
    check_nodes(nodes, num_tokens)
    is_leaf = nodes[:, 2] == nodes[:, 1]
    inner = [tuple(int(x) for x in n) for n in nodes[~is_leaf]]
    leaves = nodes[is_leaf]

    count = np.zeros(num_tokens + 1, dtype=np.int64)  # partials per token (difference array)
    np.add.at(count, nodes[:, 0], 1)
    np.add.at(count, np.where(is_leaf, nodes[:, 1], nodes[:, 2]), -1)
    width = max(1, int(np.cumsum(count).max()))
    lens = leaves[:, 1] - leaves[:, 0]
    leaf_len = -(-int(lens.max()) // LEAF_MULTIPLE) * LEAF_MULTIPLE if len(leaves) else 0
    src = np.full((num_tokens, width), -1, dtype=np.int64)
    slot = np.zeros(num_tokens, dtype=np.int64)
    kv_src = np.full(num_tokens, -1, dtype=np.int64)
    for part, (s, e, x) in enumerate(inner):  # preorder: ancestors take a token's first slots
        code = (part << 32) + np.arange(x - s)
        src[np.arange(s, x), slot[s:x]] = code
        slot[s:x] += 1
        kv_src[s:e] = code[:e - s]

    leaf_index = leaf_valid = None
    if len(leaves):
        slot_pos = np.arange(leaf_len)[None, :]
        valid = slot_pos < lens[:, None]                                    # [leaves, L]
        index = leaves[:, :1] + np.minimum(slot_pos, lens[:, None] - 1)     # padding: last token
        idx = index[valid]                                                  # real slots, in order
        code = (len(inner) << 32) + (np.arange(len(leaves))[:, None] * leaf_len + slot_pos)[valid]
        src[idx, slot[idx]] = code
        kv_src[idx] = code
        leaf_index = torch.from_numpy(index.reshape(-1)).to(device)
        leaf_valid = torch.from_numpy(valid.reshape(-1)).to(device)
    return SplitPlan(num_tokens, inner, leaf_index, leaf_valid, leaf_len,
                     torch.from_numpy(src).to(device), torch.from_numpy(kv_src[:, None]).to(device))

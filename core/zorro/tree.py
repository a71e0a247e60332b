"""Prefix forest of a batch: every token shared by several samples is stored once.

Each sample's full sequence (prompt + response) is inserted into a radix tree. Whole identical
prompts (a GRPO group), partly shared prompts (a system prompt before different questions,
multi-turn histories) and even identical responses all collapse onto shared nodes. Nodes are
laid out in depth-first preorder, so a node's ancestors always precede it, and "j is visible
from i" is the O(1) test ``tin[j] <= tin[i] and tout[i] <= tout[j] and j <= i`` on the
preorder interval ``[tin, tout]`` of the nodes holding the two tokens.

``separate_forest`` is the same layout with nothing shared: every sequence is a root node of its
own (the packed naive layout — one causal segment per sample, as verl's remove-padding runs).

The build sorts the sequences (adjacent sequences then share the longest prefixes), takes the
longest common prefix of neighbours with numpy, and turns the sorted list into a radix tree with
a stack — O(total tokens) array work plus O(samples) Python steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Forest:
    """A batch's prefix forest, nodes in DFS preorder.

    Attributes:
        tokens: ``[T]`` the deduplicated tokens, node after node in preorder.
        depth: ``[T]`` each token's position in its sequence (its RoPE position).
        node_of: ``[T]`` preorder index of the node holding each token.
        node_offset, node_len, node_parent, node_tout, node_root: ``[N]`` per node (parent -1
            for roots; ``tout`` = last preorder index inside the node's subtree; ``root`` = the
            preorder index of the tree the node belongs to).
        sample_pos: per sample, ``[len(prompt) + len(response)]`` indices into ``tokens``.
        sample_root: ``[B]`` the tree (root node) each sample lives in.
    """

    tokens: np.ndarray
    depth: np.ndarray
    node_of: np.ndarray
    node_offset: np.ndarray
    node_len: np.ndarray
    node_parent: np.ndarray
    node_tout: np.ndarray
    node_root: np.ndarray
    sample_pos: list[np.ndarray]
    sample_root: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def build_forest(seqs: list[np.ndarray]) -> Forest:
    """Build the prefix forest of non-empty int64 token sequences (see module docstring)."""
    n = len(seqs)
    order = sorted(range(n), key=lambda i: seqs[i].astype(">i8").tobytes())
    # Radix-tree nodes: token span [start, end) of an owner sequence; node 0 is a virtual root.
    start, end, parent, owner, children = [0], [0], [-1], [-1], [[]]
    leaf_of = [0] * n
    stack = [0]
    prev = None
    for i in order:
        s = seqs[i]
        lcp = 0 if prev is None else _lcp(prev, s)
        while stack[-1] != 0 and start[stack[-1]] >= lcp:
            stack.pop()
        top = stack[-1]
        if top != 0 and end[top] > lcp:  # split `top` at depth lcp: a new upper part takes its place
            up = len(start)
            start.append(start[top]); end.append(lcp); parent.append(parent[top])
            owner.append(owner[top]); children.append([top])
            siblings = children[parent[top]]
            siblings[siblings.index(top)] = up
            parent[top] = up
            start[top] = lcp
            stack[-1] = top = up
        if s.size > lcp:
            leaf = len(start)
            start.append(lcp); end.append(s.size); parent.append(top); owner.append(i); children.append([])
            children[top].append(leaf)
            stack.append(leaf)
            leaf_of[i] = leaf
        else:  # identical to the previous sequence (a strict prefix would have sorted first)
            leaf_of[i] = top
        prev = s

    # Preorder layout (iterative DFS over the virtual root's children).
    num = len(start) - 1
    pre = np.empty(len(start), dtype=np.int64)  # tree-node id -> preorder index
    node_ids = []
    todo = list(reversed(children[0]))
    while todo:
        v = todo.pop()
        pre[v] = len(node_ids)
        node_ids.append(v)
        todo.extend(reversed(children[v]))
    node_len = np.array([end[v] - start[v] for v in node_ids], dtype=np.int64)
    node_offset = np.concatenate([[0], np.cumsum(node_len)[:-1]]) if num else np.zeros(0, np.int64)
    node_parent = np.array([pre[parent[v]] if parent[v] != 0 else -1 for v in node_ids], dtype=np.int64)
    node_tout = np.arange(num, dtype=np.int64)
    for k in range(num - 1, -1, -1):  # children come after parents in preorder
        p = node_parent[k]
        if p >= 0 and node_tout[k] > node_tout[p]:
            node_tout[p] = node_tout[k]
    node_root = np.empty(num, dtype=np.int64)
    for k in range(num):
        node_root[k] = k if node_parent[k] < 0 else node_root[node_parent[k]]

    tokens = np.concatenate([seqs[owner[v]][start[v]:end[v]] for v in node_ids])
    depth = np.concatenate([np.arange(start[v], end[v]) for v in node_ids])
    node_of = np.repeat(np.arange(num), node_len)

    sample_pos, sample_root = [], np.empty(n, dtype=np.int64)
    for i in range(n):
        path, k = [], int(pre[leaf_of[i]])
        sample_root[i] = node_root[k]
        while k >= 0:
            path.append(k)
            k = int(node_parent[k])
        sample_pos.append(np.concatenate([np.arange(node_offset[k], node_offset[k] + node_len[k])
                                          for k in reversed(path)]))
    return Forest(tokens, depth, node_of, node_offset, node_len, node_parent, node_tout,
                  node_root, sample_pos, sample_root)


def separate_forest(seqs: list[np.ndarray]) -> Forest:
    """Every non-empty sequence its own root leaf, in input order (nothing shared)."""
    n = len(seqs)
    node_len = np.array([s.size for s in seqs], dtype=np.int64)
    node_offset = np.concatenate([[0], np.cumsum(node_len)[:-1]]).astype(np.int64) if n else node_len
    nodes = np.arange(n, dtype=np.int64)
    return Forest(tokens=np.concatenate(seqs) if n else np.zeros(0, np.int64),
                  depth=np.concatenate([np.arange(s.size) for s in seqs]) if n else np.zeros(0, np.int64),
                  node_of=np.repeat(nodes, node_len), node_offset=node_offset, node_len=node_len,
                  node_parent=np.full(n, -1, dtype=np.int64), node_tout=nodes.copy(),
                  node_root=nodes.copy(),
                  sample_pos=[node_offset[i] + np.arange(node_len[i]) for i in range(n)],
                  sample_root=nodes.copy())

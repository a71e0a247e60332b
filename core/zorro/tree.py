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

``build_forest(seqs, prompt_lens=..., min_shared=k)`` shares a span that different prompts
start with (a chat template's header, a system prompt, a multi-turn history before different
questions) only when its node has at least ``k`` tokens; a shorter one is repeated at the head
of each branch below it (``_unshare_short``). On the GPU's split path every shared span costs
each token below it one more attention partial (one more call, one more term in the
log-sum-exp merge, forward and backward): for a chat template's dozen tokens in front of several
long prompt groups that is far more work than repeating the dozen tokens. Spans inside one
prompt group (the prompt its G responses share, identical responses) are always shared. ZoRRo's
layout and its micro-batch planner use ``MIN_SHARED_TOKENS``; the default, 1, is maximal
sharing. Every sequence's tokens and positions are exact either way, so log-probs and gradients
do not change.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# ZoRRo's layout shares no head of different prompts shorter than this (module docstring).
# Measured once (H100, 2026-12-07, BENCHMARKS recipe section): an 11-token head over 8 groups of
# ~7.4k tokens cost 88 ms of a 1.05 s forward/backward shared, nothing measurable repeated. The
# threshold itself is an estimate: a head shared by c prompt groups pays back its extra partial
# only when (c - 1) * its length is a sizeable fraction of the tokens behind it; heads of 12-63
# tokens are not measured. 64 repeats every chat-template header, keeps a real system prompt shared.
MIN_SHARED_TOKENS = 64


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


def build_forest(seqs: list[np.ndarray], prompt_lens: list[int] | None = None,
                 min_shared: int = 1) -> Forest:
    """Build the prefix forest of non-empty int64 token sequences (see module docstring).

    ``prompt_lens`` (each sequence's prompt length, ``0 <= len <= len(seq)``) with
    ``min_shared > 1``: a span that different prompts share is shared only when it has at least
    ``min_shared`` tokens. ``ValueError`` when ``prompt_lens`` is missing or does not fit.
    """
    n = len(seqs)
    if isinstance(min_shared, bool) or not isinstance(min_shared, int) or min_shared < 1:
        raise ValueError(f"build_forest: min_shared must be an int >= 1 (1: share every prefix), "
                         f"got {min_shared!r}")
    if min_shared > 1:
        if prompt_lens is None or len(prompt_lens) != n:
            raise ValueError(f"build_forest: min_shared={min_shared} needs prompt_lens, one per "
                             f"sequence ({n}); got {None if prompt_lens is None else len(prompt_lens)}")
        bad = [i for i, (s, k) in enumerate(zip(seqs, prompt_lens)) if not 0 <= k <= s.size]
        if bad:
            raise ValueError(f"build_forest: prompt_lens[{bad[0]}] = {prompt_lens[bad[0]]} is not "
                             f"within its sequence's {seqs[bad[0]].size} tokens")
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

    if min_shared > 1:
        _unshare_short(start, end, parent, children, leaf_of, prompt_lens, min_shared)

    # Preorder layout (iterative DFS over the virtual root's children; unshared nodes are gone).
    pre = np.empty(len(start), dtype=np.int64)  # tree-node id -> preorder index
    node_ids = []
    todo = list(reversed(children[0]))
    while todo:
        v = todo.pop()
        pre[v] = len(node_ids)
        node_ids.append(v)
        todo.extend(reversed(children[v]))
    num = len(node_ids)
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


def _unshare_short(start: list, end: list, parent: list, children: list, leaf_of: list,
                   prompt_lens, min_shared: int) -> None:
    """Replace every node of fewer than ``min_shared`` tokens whose branches part inside a prompt
    (some sequence below it is still in its prompt there: the node is a head of different
    prompts) by its children, each of which takes the node's tokens in front of its own; a node
    some sequence ends in stays as that sequence's leaf. Lengths are the tree's as built (what a
    child absorbs does not count), which keeps the rule monotone: a subset of the sequences has
    no shorter nodes and no longer prompts, so it repeats no more than the whole batch does, and
    the micro-batch planner's token counts, taken on the whole batch, bound every part's. A
    prompt group's own prompt, where its responses branch off, is never such a node. Edits the
    radix tree's lists in place."""
    longest = [0] * len(start)  # per node: the longest prompt of the sequences below it
    for i, v in enumerate(leaf_of):
        n = int(prompt_lens[i])
        while v != 0 and longest[v] < n:  # an ancestor already as long got it from below
            longest[v] = n
            v = parent[v]
    endpoints = set(leaf_of)
    short = [e - s < min_shared for s, e in zip(start, end)]  # judged on the tree as built
    todo = list(children[0])
    while todo:
        v = todo.pop()
        kids = children[v]
        if kids and short[v] and end[v] < longest[v]:
            siblings = children[parent[v]]
            at = siblings.index(v)
            # same place, so the sorted (preorder) order is kept; a node some sequence ends in
            # stays as that sequence's leaf, before the branches that now repeat its tokens
            siblings[at:at + 1] = ([v] if v in endpoints else []) + kids
            for c in kids:
                start[c], parent[c] = start[v], parent[v]  # c's owner runs through v's tokens
            children[v] = []
        todo.extend(kids)


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

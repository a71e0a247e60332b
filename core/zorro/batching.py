"""Cut a batch into parts of whole prompt groups: packed rows, micro-batches, data-parallel shards.

A *prompt group* is the unit that is never split: the samples with one ``group_id``, or, when a
batch has no ``group_ids``, the samples with identical prompt tokens (a GRPO group). Sharing
*between* groups (a chat template's leading tokens, a system prompt, a multi-turn history) does
not tie groups together: when groups that share a prefix land in different parts, each part
carries its own copy of that prefix (computed once per part, still never once per sample).

What a part costs is measured on the whole batch's prefix forest (``layout_forest``:
``tree.build_forest`` with the layout's ``MIN_SHARED_TOKENS``): every forest token is one
distinct shared prefix, so the deduplicated tokens of any set of groups are the size of the union
of their samples' token positions. With ``zorro=False`` a part costs every sample's prompt +
response tokens. Parts are filled first-fit-decreasing under a token budget
(``split_batch(batch, max_tokens)``; a group over budget gets a part of its own) and then
rebalanced over the same number of parts when that keeps every part within budget; exactly
``num_parts`` parts (data-parallel shards) are balanced largest-group-first, each group going
where it adds the fewest tokens to the lightest part.

``plan_micro_batches`` combines the two for one data-parallel rank. Every rank holds the same
global batch, so every rank computes the same plan for all ranks without communicating.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..types import RolloutBatch
from . import tree


def sequences(batch: RolloutBatch, rows: list[int] | None = None) -> list[np.ndarray]:
    """Prompt + response token ids of ``rows`` (default: every sample), in that order."""
    rows = range(len(batch)) if rows is None else rows
    return [np.concatenate([batch.prompts[i], batch.responses[i]]) for i in rows]


def layout_forest(batch: RolloutBatch, rows: list[int] | None = None) -> tree.Forest:
    """The prefix forest of ``rows`` (default: all) as ZoRRo's layout shares it: heads of
    different prompts from ``tree.MIN_SHARED_TOKENS`` tokens (``pack_rows`` lays rows out from
    it, the planner costs parts on it)."""
    rows = range(len(batch)) if rows is None else rows
    return tree.build_forest(sequences(batch, rows), [batch.prompts[i].size for i in rows],
                             tree.MIN_SHARED_TOKENS)


def prompt_groups(batch: RolloutBatch) -> list[list[int]]:
    """Row indices of each prompt group, groups in first-seen order, rows ascending.

    Equal ``group_ids`` form a group; without ``group_ids``, identical prompts do.
    """
    keys = batch.group_ids if batch.group_ids is not None else [p.tobytes() for p in batch.prompts]
    groups: dict = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return list(groups.values())


@dataclass
class _Groups:
    """The groups of one batch with the forest token positions each group needs."""

    rows: list[list[int]]
    tokens: list[np.ndarray]  # per group: distinct positions in the batch forest (or fake ones)
    num_tokens: int  # size of the position space

    @classmethod
    def of(cls, batch: RolloutBatch, zorro: bool) -> _Groups:
        rows = prompt_groups(batch)
        if zorro:
            forest = layout_forest(batch)
            toks = [np.unique(np.concatenate([forest.sample_pos[i] for i in g])) for g in rows]
            return cls(rows, toks, forest.num_tokens)
        sizes = [sum(batch.prompts[i].size + batch.responses[i].size for i in g) for g in rows]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return cls(rows, [np.arange(starts[k], starts[k + 1]) for k in range(len(rows))], int(starts[-1]))

    def cost(self, k: int) -> int:
        return int(self.tokens[k].size)


class _Part:
    """Groups assigned to one part and the forest positions they cover."""

    def __init__(self, space: int):
        self.groups: list[int] = []
        self.covered = np.zeros(space, dtype=bool)
        self.load = 0

    def extra(self, toks: np.ndarray) -> int:
        return int(toks.size - np.count_nonzero(self.covered[toks]))

    def add(self, k: int, toks: np.ndarray) -> None:
        self.load += self.extra(toks)
        self.covered[toks] = True
        self.groups.append(k)


def _largest_first(g: _Groups, ks: list[int]) -> list[int]:
    return sorted(ks, key=lambda k: (-g.cost(k), k))


def _first_fit(g: _Groups, ks: list[int], budget: int) -> list[_Part]:
    parts: list[_Part] = []
    for k in _largest_first(g, ks):
        for p in parts:
            if p.load + p.extra(g.tokens[k]) <= budget:
                p.add(k, g.tokens[k])
                break
        else:
            parts.append(_Part(g.num_tokens))
            parts[-1].add(k, g.tokens[k])
    return parts


def _balanced(g: _Groups, ks: list[int], n: int) -> list[_Part]:
    order = _largest_first(g, ks)
    parts = [_Part(g.num_tokens) for _ in range(n)]
    for p, k in zip(parts, order):  # every part gets one of the n largest groups
        p.add(k, g.tokens[k])
    for k in order[n:]:
        best = min(parts, key=lambda p: p.load + p.extra(g.tokens[k]))
        best.add(k, g.tokens[k])
    return parts


def _split(g: _Groups, ks: list[int], max_tokens: int | None, num_parts: int | None) -> list[list[int]]:
    if num_parts is not None:
        if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
            raise ValueError(f"num_parts must be an int >= 1, got {num_parts!r}")
        if len(ks) < num_parts:
            raise ValueError(f"cannot split {len(ks)} prompt group(s) into {num_parts} parts: give each "
                             "data-parallel rank at least one group (more prompts per step, or fewer ranks)")
        parts = _balanced(g, ks, num_parts)
    elif max_tokens is None:
        parts = [_Part(g.num_tokens)]
        for k in ks:
            parts[0].add(k, g.tokens[k])
    else:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        parts = _first_fit(g, ks, max_tokens)
        if len(parts) > 1:
            even = _balanced(g, ks, len(parts))
            fits = all(p.load <= max_tokens or len(p.groups) == 1 for p in even)
            if fits and max(p.load for p in even) < max(p.load for p in parts):
                parts = even
    return [sorted(i for k in p.groups for i in g.rows[k]) for p in parts]


def split_batch(batch: RolloutBatch, max_tokens: int | None = None, *, zorro: bool = True,
                num_parts: int | None = None) -> list[list[int]]:
    """Cut a batch into parts made of whole prompt groups (see module docstring).

    Args:
        batch: the samples.
        max_tokens: token budget per part (deduplicated tokens with ``zorro``, counting a prefix
            once per part; else prompt + response tokens of every sample). A group over budget
            becomes a part of its own. None (and no ``num_parts``): one part.
        zorro: measure parts by deduplicated tokens.
        num_parts: instead of a budget, exactly this many parts balanced by tokens (data-parallel
            shards); ``ValueError`` if the batch has fewer prompt groups than parts.
    Returns:
        row-index lists, ascending within each part; together they hold every row once.
    """
    g = _Groups.of(batch, zorro)
    return _split(g, list(range(len(g.rows))), max_tokens, num_parts)


def plan_micro_batches(batch: RolloutBatch, *, rank: int, world: int, max_tokens: int,
                       zorro: bool) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches of a global batch: ``[(rows, real), ...]``.

    The batch is cut into ``world`` shards of whole prompt groups balanced by tokens, then each
    shard into micro-batches under ``max_tokens``. Every rank gets the same number of
    micro-batches (collectives inside forward/backward must line up): a rank with fewer repeats
    its smallest one with ``real=False`` (to be weighted 0). The plan of every rank is computed
    here from the global batch, so no communication is needed. ``ValueError`` if there are
    fewer prompt groups than ranks.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} rank(s)")
    g = _Groups.of(batch, zorro)
    everything = list(range(len(g.rows)))
    if world == 1:
        shards = [everything]
    else:
        by_row = {i: k for k, rows in enumerate(g.rows) for i in rows}
        shards = [sorted({by_row[i] for i in shard})
                  for shard in _split(g, everything, None, world)]
    plans = [_split(g, ks, max_tokens, None) for ks in shards]
    n = max(len(p) for p in plans)
    mine = plans[rank]
    smallest = min(mine, key=len)
    return [(p, True) for p in mine] + [(smallest, False)] * (n - len(mine))

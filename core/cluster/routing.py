"""Route prompt groups to sampler replicas so that prefix sharing works.

A prompt and its ``n`` samples always go to one replica (its forks share the prompt's KV
pages), and identical prompts in one call go to the same replica (the prefix cache hits).
Groups are placed greedily on the replica with the fewest tokens so far, largest first.
"""

from __future__ import annotations

from typing import Sequence

from ..types import SamplingParams, as_token_array


def route_prompts(
    prompts: Sequence, params: SamplingParams | Sequence[SamplingParams], num_replicas: int
) -> list[list[int]]:
    """Prompt indices per replica (each list in the caller's order).

    Args:
        prompts: token-id sequences. params: one ``SamplingParams`` or one per prompt.
        num_replicas: sampler replicas (>= 1).
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(as_token_array(p, f"prompts[{i}]").tolist()), []).append(i)
    cost = {
        key: sum(len(key) + plist[i].n * plist[i].max_tokens for i in idx)
        for key, idx in groups.items()
    }
    load = [0] * num_replicas
    out: list[list[int]] = [[] for _ in range(num_replicas)]
    for key in sorted(groups, key=lambda k: -cost[k]):
        r = min(range(num_replicas), key=lambda j: load[j])
        load[r] += cost[key]
        out[r].extend(groups[key])
    return [sorted(o) for o in out]


def merge_routed(routes: list[list[int]], results: list[list], total: int) -> list:
    """Put per-replica results back in the caller's prompt order."""
    out: list = [None] * total
    for idx, res in zip(routes, results):
        if len(idx) != len(res):
            raise RuntimeError(
                f"a sampler replica answered {len(res)} prompts, {len(idx)} were sent"
            )
        for i, r in zip(idx, res):
            out[i] = r
    return out

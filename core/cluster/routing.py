"""Route prompt groups to sampler replicas so that prefix sharing works and the load spreads.

A prompt and its ``n`` samples always go to one replica (its forks share the prompt's KV
pages), and identical prompts in one call go to the same replica (the prefix cache hits).
Groups are placed greedily on the replica with the least work, largest first.

``ReplicaRouter`` does this against the calls in flight, as a client serving concurrent calls
needs (an HTTP server's requests, an agent loop's one-sample calls): each replica's work is
the tokens of the calls it is running, and a prompt already running on a replica goes to that
replica (the G separate requests of one GRPO group share its pages there, and FCA reads them
once), so one-prompt calls neither pile onto the first replica nor scatter a group.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from ..types import as_token_array, params_per_prompt

Key = tuple[int, ...]


def _groups(prompts: Sequence, params) -> tuple[dict[Key, list[int]], dict[Key, int]]:
    """Prompt indices by prompt, and each group's cost (prompt + sampled tokens)."""
    plist = params_per_prompt(prompts, params)
    groups: dict[Key, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(as_token_array(p, f"prompts[{i}]").tolist()), []).append(i)
    cost = {key: sum(len(key) + plist[i].n * plist[i].max_tokens for i in idx)
            for key, idx in groups.items()}
    return groups, cost


def _place(groups: dict[Key, list[int]], cost: dict[Key, int], load: list[int],
           pinned: dict[Key, int]) -> tuple[list[list[int]], dict[Key, int]]:
    """Per replica, its prompt indices (sorted), and the replica of every group; ``load`` is
    updated in place."""
    out: list[list[int]] = [[] for _ in load]
    where: dict[Key, int] = {}
    for key in sorted(groups, key=lambda k: -cost[k]):
        r = pinned.get(key)
        if r is None:
            r = min(range(len(load)), key=lambda j: load[j])
        load[r] += cost[key]
        out[r].extend(groups[key])
        where[key] = r
    return [sorted(o) for o in out], where


class ReplicaRouter:
    """Routes calls over ``num_replicas`` replicas against the work in flight (module
    docstring). Thread-safe; ``route`` holds a call's share until its block exits::

        with router.route(prompts, params) as routes:
            ...  # send routes[r] to replica r
    """

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self._load = [0] * num_replicas
        self._running: dict[Key, list[int]] = {}  # prompt -> [replica, calls running it]
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def route(self, prompts: Sequence, params) -> Iterator[list[list[int]]]:
        groups, cost = _groups(prompts, params)  # bad input raises before anything is held
        with self._lock:
            pinned = {k: self._running[k][0] for k in groups if k in self._running}
            routes, where = _place(groups, cost, self._load, pinned)
            for key, r in where.items():
                self._running.setdefault(key, [r, 0])[1] += 1
        try:
            yield routes
        finally:
            with self._lock:
                for key, r in where.items():
                    self._load[r] -= cost[key]
                    entry = self._running[key]
                    entry[1] -= 1
                    if not entry[1]:
                        del self._running[key]

    def load(self) -> list[int]:
        """Tokens (prompt + to be sampled) of the calls running on each replica."""
        with self._lock:
            return list(self._load)


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

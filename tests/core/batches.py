"""Random rollout batches with the shapes ZoRRo must get right (shared helper for tests)."""
from __future__ import annotations

import random

from polynya import RolloutBatch
from polynya.zorro.tree import MIN_SHARED_TOKENS


def random_batch(rng: random.Random, vocab: int, *, groups: int = 4, max_group: int = 8,
                 max_prompt: int = 24, max_response: int = 12, system_prompt: bool = True,
                 shuffle: bool = True, with_group_ids: bool = False) -> RolloutBatch:
    """Groups of 1..max_group samples sharing a prompt; ragged lengths; every prompt starts with
    the same few tokens (as a chat template's header does: ZoRRo's layout repeats such a short
    head per prompt), half of them also with a system prompt long enough to be shared
    (``MIN_SHARED_TOKENS``: deeper partial sharing); one response duplicated; rows shuffled."""
    template = [rng.randrange(2, vocab) for _ in range(3)]
    system = [rng.randrange(2, vocab) for _ in range(rng.randint(MIN_SHARED_TOKENS, MIN_SHARED_TOKENS + 8))]
    prompts, responses, gids = [], [], []
    for g in range(groups):
        question = [rng.randrange(2, vocab) for _ in range(rng.randint(1, max_prompt))]
        prompt = template + ((system + question) if system_prompt and g % 2 == 0 else question)
        for _ in range(rng.randint(1, max_group)):
            prompts.append(prompt)
            responses.append([rng.randrange(2, vocab) for _ in range(rng.randint(1, max_response))])
            gids.append(g)
    prompts.append(prompts[0])  # an identical (prompt, response) pair: shared completely
    responses.append(list(responses[0]))
    gids.append(gids[0])
    order = list(range(len(prompts)))
    if shuffle:
        rng.shuffle(order)
    return RolloutBatch([prompts[i] for i in order], [responses[i] for i in order],
                        group_ids=[gids[i] for i in order] if with_group_ids else None)

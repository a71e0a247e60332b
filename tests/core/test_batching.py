"""Group-aware batching: micro-batches and data-parallel shards hold whole prompt groups, a
prefix shared by several groups (chat template, system prompt) no longer ties them together,
budgets hold on the real deduplicated token count, and the split step equals the unsplit one."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from polynya import RolloutBatch, compute_logprobs
from polynya.losses import Normalizer, policy_loss, resolve_loss
from polynya.models import load_model, load_tokenizer
from polynya.zorro import build_forest, plan_micro_batches, prompt_groups, split_batch
from polynya.zorro.tree import MIN_SHARED_TOKENS

from .batches import random_batch


def _dedup_tokens(batch: RolloutBatch, rows: list[int]) -> int:
    """The oracle: size of the prefix forest of exactly these rows, as ZoRRo's layout builds it."""
    return build_forest([np.concatenate([batch.prompts[i], batch.responses[i]]) for i in rows],
                        [batch.prompts[i].size for i in rows], MIN_SHARED_TOKENS).num_tokens


def _group_of(batch: RolloutBatch) -> dict[int, int]:
    return {i: k for k, g in enumerate(prompt_groups(batch)) for i in g}


def _assert_whole_groups(batch: RolloutBatch, parts: list[list[int]]) -> None:
    assert sorted(i for p in parts for i in p) == list(range(len(batch)))
    assert all(p == sorted(p) and p for p in parts)
    of = _group_of(batch)
    owner = {}
    for n, p in enumerate(parts):
        for i in p:
            assert owner.setdefault(of[i], n) == n, "a prompt group was split"


def test_prompt_groups_from_ids_or_identical_prompts():
    b = RolloutBatch([[1, 2], [1, 2, 3], [1, 2], [4]], [[5], [6], [7], [8]])
    assert prompt_groups(b) == [[0, 2], [1], [3]]  # [1, 2] is a prefix of [1, 2, 3]: other group
    b = RolloutBatch(b.prompts, b.responses, group_ids=[9, 9, 4, 9])
    assert prompt_groups(b) == [[0, 1, 3], [2]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_ids", [False, True])
def test_budget_parts_are_whole_groups_within_budget(seed, with_ids):
    rng = random.Random(seed)
    batch = random_batch(rng, vocab=40, groups=9, with_group_ids=with_ids)
    whole = _dedup_tokens(batch, list(range(len(batch))))
    of = _group_of(batch)
    for budget in (whole // 4, whole // 2, whole):
        for zorro in (True, False):
            parts = split_batch(batch, budget, zorro=zorro)
            _assert_whole_groups(batch, parts)
            for p in parts:
                cost = _dedup_tokens(batch, p) if zorro else sum(
                    batch.prompts[i].size + batch.responses[i].size for i in p)
                assert cost <= budget or len({of[i] for i in p}) == 1
    # every prompt shares the template head: the old tree-based units made this one part
    assert len(split_batch(batch, whole // 2)) >= 2
    assert split_batch(batch, whole) == [list(range(len(batch)))]


@pytest.mark.parametrize("seed", range(4))
def test_data_parallel_shards_balanced_by_tokens(seed):
    rng = random.Random(seed)
    batch = random_batch(rng, vocab=40, groups=8, max_group=4, with_group_ids=seed % 2 == 0)
    costs = sorted((_dedup_tokens(batch, g) for g in prompt_groups(batch)), reverse=True)
    for n in (2, 3, 8):
        parts = split_batch(batch, num_parts=n)
        assert len(parts) == n
        _assert_whole_groups(batch, parts)
        loads = [_dedup_tokens(batch, p) for p in parts]
        # greedy largest-first bound: no part exceeds the mean by more than the largest group
        assert max(loads) <= sum(costs) / n + costs[0]
    with pytest.raises(ValueError, match="cannot split 8 prompt group"):
        split_batch(batch, num_parts=9)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_parts"):
            split_batch(batch, num_parts=bad)
        with pytest.raises(ValueError, match="max_tokens"):
            split_batch(batch, bad if bad != 1.5 else 0.5)


def test_micro_batch_plan_same_count_on_every_rank():
    rng = random.Random(3)
    batch = random_batch(rng, vocab=40, groups=7, max_group=6)
    budget = _dedup_tokens(batch, list(range(len(batch)))) // 3
    plans = [plan_micro_batches(batch, rank=r, world=3, max_tokens=budget, zorro=True) for r in range(3)]
    assert len({len(p) for p in plans}) == 1
    real = [rows for p in plans for rows, ok in p if ok]
    _assert_whole_groups(batch, real)
    for p in plans:  # padding repeats a real micro-batch of the same rank, weighted 0
        own = [rows for rows, ok in p if ok]
        assert all(rows in own for rows, ok in p if not ok)
    with pytest.raises(ValueError, match="rank 3"):
        plan_micro_batches(batch, rank=3, world=3, max_tokens=budget, zorro=True)


def _chat_batch(seed: int, groups: int = 8, per_group: int = 3) -> RolloutBatch:
    """8 prompt groups through the tokenizer's chat template (a shared system message), random
    responses and advantages: every sample shares the template's leading tokens."""
    tok = load_tokenizer("tiny:qwen3")
    rng = random.Random(seed)
    words = "how many apples does the farmer sell each week in total".split()
    prompts, responses, adv = [], [], []
    for g in range(groups):
        q = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + "?"
        ids = tok.apply_chat_template([{"role": "system", "content": "Answer the question."},
                                       {"role": "user", "content": q}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        for _ in range(per_group):
            prompts.append(ids)
            responses.append([rng.randrange(2, 500) for _ in range(rng.randint(2, 9))])
            adv.append(rng.gauss(0, 1))
    return RolloutBatch(prompts, responses, advantages=torch.tensor(adv))


def _loss_and_grads(model, batch: RolloutBatch, parts: list[list[int]]):
    spec = resolve_loss("grpo")
    norm = Normalizer.from_mask(batch.response_mask())
    model.zero_grad()
    total = 0.0
    for rows in parts:
        mb = batch.select(rows)
        stats = compute_logprobs(model, mb, zorro=True)
        out = policy_loss(spec, stats.logprobs, mb.advantages, stats.mask, norm,
                          old_logprobs=stats.logprobs.detach() + 0.01)
        out.loss.backward()
        total += float(out.loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_chat_templated_batch_splits_and_matches_unsplit_step():
    batch = _chat_batch(0)
    head = len(batch.prompts[0]) - 1
    assert len(prompt_groups(batch)) == 8
    assert len({tuple(p[:4]) for p in batch.prompts}) == 1 and head > 8  # shared template head
    whole = _dedup_tokens(batch, list(range(len(batch))))
    micro = plan_micro_batches(batch, rank=0, world=1, max_tokens=whole // 3, zorro=True)
    assert len(micro) >= 2 and all(real for _, real in micro)
    shards = [plan_micro_batches(batch, rank=r, world=2, max_tokens=whole // 3, zorro=True) for r in (0, 1)]
    assert [len({i for rows, _ in s for i in rows}) > 0 for s in shards] == [True, True]
    _assert_whole_groups(batch, [rows for s in shards for rows, real in s if real])

    model = load_model("tiny:qwen3", dtype="float32")
    ref_loss, ref_grads = _loss_and_grads(model, batch, [list(range(len(batch)))])
    for parts in ([rows for rows, _ in micro], [rows for s in shards for rows, real in s if real]):
        loss, grads = _loss_and_grads(model, batch, parts)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
        assert grads.keys() == ref_grads.keys()
        for n in grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5)

"""polynya.adapters.trl.translate: TRL's padded layout <-> RolloutBatch, group-whole shuffles."""
from __future__ import annotations

import pytest
import torch
from polynya.adapters.trl.translate import (
    check_groups,
    group_chunks,
    group_permutation,
    permute_rows,
    rollout_batch,
    to_trl_layout,
    unique_prompts,
)


def _trl_layout(prompts, completions, pad=1):
    """Build TRL's [left-padded prompt | right-padded completion] tensors (the oracle)."""
    p_w, c_w = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), p_w + c_w), pad)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, p_w - len(p):p_w] = torch.tensor(p)
        mask[i, p_w - len(p):p_w] = 1
        if c:
            ids[i, p_w:p_w + len(c)] = torch.tensor(c)
            mask[i, p_w:p_w + len(c)] = 1
    return ids, mask, c_w


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rollout_batch_reads_trl_layout(seed):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(2, 500, (n,), generator=g).tolist()
    lens = torch.randint(1, 9, (7, 2), generator=g).tolist()
    prompts = [rand(a) for a, _ in lens]
    completions = [rand(b) for _, b in lens]
    completions[3] = []  # a completion TRL masked out entirely
    ids, mask, keep = _trl_layout(prompts, completions)
    batch = rollout_batch(ids, mask, keep)
    assert [p.tolist() for p in batch.prompts] == prompts
    assert [r.tolist() for r in batch.responses] == completions
    vals = torch.randn(len(prompts), batch.max_response_len)
    out = to_trl_layout(vals, keep)
    assert out.shape == (len(prompts), keep) and torch.equal(out[:, :vals.shape[1]], vals)


def test_rollout_batch_refuses_masks_it_would_misread():
    ids, mask, keep = _trl_layout([[5, 6, 7], [8, 9]], [[10, 11], [12]])
    holed = mask.clone()
    holed[0, 1] = 0  # a hole inside the prompt
    with pytest.raises(ValueError, match="row 0"):
        rollout_batch(ids, holed, keep)
    left_padded_completion = mask.clone()
    left_padded_completion[1, -keep:] = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="row 1"):
        rollout_batch(ids, left_padded_completion, keep)


def test_unique_prompts_and_group_chunks():
    prompts, counts = unique_prompts([[1, 2], [1, 2], [1, 2], [3], [3], [1, 2]])
    assert prompts == [[1, 2], [3], [1, 2]] and counts == [3, 2, 1]
    ids, mask, keep = _trl_layout([[1, 2]] * 3 + [[3]] * 3, [[4]] * 6)
    chunks = group_chunks(rollout_batch(ids, mask, keep), 2)
    assert [list(c) for c in chunks] == [[0, 1, 2], [3, 4, 5]]  # never cuts a group


def test_group_permutation_moves_whole_groups():
    perm = group_permutation(12, 4, torch.Generator().manual_seed(0))
    assert sorted(perm.tolist()) == list(range(12))
    for block in perm.view(3, 4):
        assert block.tolist() == list(range(int(block[0]), int(block[0]) + 4))
    batch = {"a": torch.arange(12), "b": list(range(12)), "c": torch.tensor(3.0), "d": None}
    out = permute_rows(batch, perm)
    assert out["a"].tolist() == perm.tolist() == out["b"] and out["c"] == 3.0 and out["d"] is None
    with pytest.raises(ValueError, match="groups of 5"):
        group_permutation(12, 5)


def test_check_groups():
    ids, mask, _ = _trl_layout([[1, 2]] * 2 + [[3]] * 2, [[4]] * 4)
    check_groups(ids[:, :2], mask[:, :2], 2)
    with pytest.raises(ValueError, match="consecutive rows"):
        check_groups(ids[[0, 2, 1, 3], :2], mask[[0, 2, 1, 3], :2], 2)

import pytest
import torch

from polynya import RolloutBatch, SamplingParams


def test_batch_accepts_lists_and_tensors():
    b = RolloutBatch([[1, 2], torch.tensor([3])], [[4], torch.tensor([5, 6], dtype=torch.int32)],
                     advantages=[1.0, -1.0])
    assert len(b) == 2 and b.max_response_len == 2
    assert b.response_mask().tolist() == [[True, False], [True, True]]
    assert b.advantages.dtype == torch.float32


@pytest.mark.parametrize("kwargs, needle", [
    (dict(prompt_ids=[], response_ids=[]), "empty"),
    (dict(prompt_ids=[[1]], response_ids=[[1], [2]]), "response_ids has 2"),
    (dict(prompt_ids=[[]], response_ids=[[1]]), "prompt_ids[0] is empty"),
    (dict(prompt_ids=[[1.5]], response_ids=[[1]]), "integers"),
    (dict(prompt_ids=[[1]], response_ids=[torch.tensor([1.0])]), "integers"),
    (dict(prompt_ids=[[1]], response_ids=[[-3]]), ">= 0"),
    (dict(prompt_ids=[[1, [2]]], response_ids=[[1]]), "prompt_ids[0]"),
    (dict(prompt_ids=[[1]], response_ids=[[1]], group_ids=[0, 1]), "group_ids"),
    (dict(prompt_ids=[[1]], response_ids=[[1]], advantages=[float("nan")]), "NaN"),
    (dict(prompt_ids=[[1]], response_ids=[[1, 2]], advantages=torch.zeros(1, 3)), "advantages"),
    (dict(prompt_ids=[[1]], response_ids=[[1, 2]], old_logprobs=torch.zeros(1, 1)), "old_logprobs"),
    (dict(prompt_ids="abc", response_ids="d"), "not text"),
])
def test_batch_rejects_bad_input(kwargs, needle):
    with pytest.raises(ValueError, match=None) as e:
        RolloutBatch(**kwargs)
    assert needle in str(e.value)


def test_select_keeps_order_and_trims():
    b = RolloutBatch([[1], [2], [3]], [[1, 2, 3], [4], [5, 6]], group_ids=[7, 8, 9],
                     old_logprobs=torch.arange(9.0).view(3, 3))
    s = b.select([2, 1])
    assert [p.tolist() for p in s.prompts] == [[3], [2]]
    assert s.group_ids == [9, 8]
    assert s.old_logprobs.tolist() == [[6.0, 7.0], [3.0, 4.0]]


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(temperature=-1), dict(top_p=0), dict(top_k=0),
                                    dict(min_p=1.0), dict(max_tokens=0), dict(stop_token_ids=[-1])])
def test_sampling_params_validate(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)

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


@pytest.mark.parametrize("kwargs, needle", [
    (dict(temperature=1e-6), "pass 0 for greedy"),
    (dict(temperature=1e-39), "below 1e-05"),
    (dict(stop_at_eos=1), "stop_at_eos must be None, True or False"),
    (dict(max_tokens=2**31), "max_tokens must be at most 2147483647"),
    (dict(n=2**64), "n must be at most"),
    (dict(top_k=2**40), "top_k must be at most"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids must be in [0, 9223372036854775807]"),
])
def test_sampling_params_name_the_problem(kwargs, needle):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert needle in str(e.value)


def test_sampling_params_store_python_ints():
    """numpy / 0-d tensor ints are kept as Python ints (the engines check ``isinstance(.., int)``
    and seed generators with them)."""
    import numpy as np

    p = SamplingParams(n=np.int64(2), top_k=torch.tensor(5), max_tokens=np.int32(4), seed=np.int64(7),
                       temperature=1e-5)
    assert (p.n, p.top_k, p.max_tokens, p.seed) == (2, 5, 4, 7)
    assert all(type(v) is int for v in (p.n, p.top_k, p.max_tokens, p.seed))


@pytest.mark.parametrize("stop_token_ids, stop_at_eos, expected", [
    (None, None, {0, 1}),       # the default: the model's EOS
    ((), None, set()),          # an explicit list replaces EOS: [] never stops early
    ((7,), None, {7}),
    ((7,), True, {0, 1, 7}),    # vLLM's rule: stop ids add to EOS
    (None, True, {0, 1}),
    ((7,), False, {7}),         # vLLM's ignore_eos
    (None, False, set()),
])
def test_stop_rule(stop_token_ids, stop_at_eos, expected):
    p = SamplingParams(stop_token_ids=stop_token_ids, stop_at_eos=stop_at_eos)
    assert p.stop_ids({0, 1}) == frozenset(expected)
    assert p.stops_at_eos == bool({0, 1} & expected)


@pytest.mark.parametrize("owner", ["TrainConfig", "LogProbConfig"])
@pytest.mark.parametrize("temperature", [1e-6, float("inf")])
def test_log_prob_temperature_has_the_samplers_floor(owner, temperature):
    from polynya.config import LogProbConfig, TrainConfig

    with pytest.raises(ValueError, match=f"{owner}.temperature must be finite and >= 1e-05"):
        {"TrainConfig": TrainConfig, "LogProbConfig": LogProbConfig}[owner]("tiny:qwen3", temperature=temperature)


def test_params_per_prompt_expands_one_and_refuses_what_does_not_fit():
    """The one check the sampler, the replica router and the HTTP client share."""
    from polynya.types import SamplingParams, params_per_prompt

    p = SamplingParams(n=2)
    assert params_per_prompt([[1], [2]], p) == [p, p]
    assert params_per_prompt([], p) == []
    for prompts, params, msg in [(5, p, "prompts must be a list"), ("ab", p, "prompts must be a list"),
                                 ([[1]], [p, p], "1 prompts but 2 SamplingParams"),
                                 ([[1]], [{"n": 2}], r"params\[0\] must be a SamplingParams, got dict"),
                                 ([[1]], None, r"params must be one SamplingParams or a list of them \(one per "
                                  r"prompt\), got NoneType"),
                                 ([[1]], {"n": 2}, "got dict")]:
        with pytest.raises(ValueError, match=msg):
            params_per_prompt(prompts, params)

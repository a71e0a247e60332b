"""``polynya.client.codec``: a batch survives the wire exactly, and a payload whose lengths do not
describe its tokens is refused, never decoded into another batch."""
from __future__ import annotations

import pytest
import torch
from polynya import RolloutBatch
from polynya.client.codec import decode_batch, encode_batch
from safetensors.torch import save as st_save


def test_round_trip_is_exact():
    adv = torch.tensor([[0.5, -0.0, 3e38], [1e-40, -1e-45, -3.0]])  # signed zero, subnormals
    b = RolloutBatch([[1, 2, 3], [2**40]], [[4, 5, 6], [7]], group_ids=[3, 3], advantages=adv)
    got = decode_batch(encode_batch(b))
    assert [p.tolist() for p in got.prompts] == [[1, 2, 3], [2**40]]
    assert [r.tolist() for r in got.responses] == [[4, 5, 6], [7]]
    assert got.group_ids == [3, 3]
    assert torch.equal(got.advantages.view(torch.int32), adv.view(torch.int32))  # bit for bit


def _payload(response_lens: list[int]) -> bytes:
    return st_save({
        "prompt_ids": torch.tensor([1, 2, 3, 4]), "prompt_lens": torch.tensor([1, 1, 1, 1]),
        "response_ids": torch.tensor([10, 11, 12, 13, 14]),
        "response_lens": torch.tensor(response_lens, dtype=torch.int64),
    })


@pytest.mark.parametrize("lens, needle", [
    ([2, 2**63 - 1, 2**63 - 1, 5], "sum to 18446744073709551621"),  # an int64 sum wraps to 5
    ([2, -1, 2, 2], "negative"),
    ([1, 1, 1, 1], "sum to 4 but response_ids holds 5"),
])
def test_lengths_that_do_not_describe_the_tokens_are_refused(lens, needle):
    with pytest.raises(ValueError, match=needle):
        decode_batch(_payload(lens))


def test_generate_body_round_trips_and_refuses_keys_it_would_ignore():
    """``/rl/generate`` reads exactly what ``HTTPClient`` sends; any other key is refused (before:
    ignored, so a misspelt ``params`` or vLLM's ``sampling_params`` sampled with the defaults)."""
    from polynya import SamplingParams
    from polynya.client.codec import generate_from_json
    from polynya.client.http_client import HTTPClient

    one = SamplingParams(n=2, temperature=0.7, top_k=5, max_tokens=9, stop_token_ids=[], seed=3)
    two = [one, SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_at_eos=False)]
    for params in (one, two):
        body = HTTPClient._generate_req([[5, 6], [7]], params).json
        assert generate_from_json(body) == ([[5, 6], [7]], params)
    assert generate_from_json({"prompts": [[5]]})[1] == SamplingParams()
    for key in ("sampling_params", "param", "max_tokens"):
        with pytest.raises(ValueError, match=f"unknown field.*{key}"):
            generate_from_json({"prompts": [[5]], key: {"max_tokens": 2}})

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

import pytest
import torch

from polynya.weights import split_weight_pieces

SHAPES = {"a": torch.Size([2, 3]), "b": torch.Size([4]), "c": torch.Size([1])}


def test_every_form_splits_to_named_tensors():
    flat = torch.arange(10.0)
    forms = [[(["a", "b"], flat), ("c", torch.ones(1))], (["a", "b"], flat),
             {"a": flat[:6].view(2, 3), "b": flat[6:]}, ("c", torch.ones(1))]
    for form in forms:
        pairs = dict(split_weight_pieces(form, SHAPES))
        if "a" in pairs:
            assert pairs["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and pairs["b"].tolist() == [6, 7, 8, 9]
        if "c" in pairs:
            assert pairs["c"].tolist() == [1.0]


@pytest.mark.parametrize("weights, needle", [
    ([(["a", "b"], torch.arange(9.0))], "flat bucket"),
    ([(["zz"], torch.zeros(1))], "unknown"),
    ([("zz", torch.zeros(1))], "unknown"),
    ([("b", torch.zeros(3))], "shape"),
    ([("b", [1, 2, 3, 4])], "tensors"),
    ([("b",)], "weight piece"),
])
def test_bad_pieces_raise(weights, needle):
    with pytest.raises(ValueError, match=needle):
        split_weight_pieces(weights, SHAPES)

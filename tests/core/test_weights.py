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


def _params():
    return {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(3, 2).t()}  # c strided


@pytest.mark.parametrize("offsets, length", [
    (None, None),            # packed
    ((0, 6, 10), 16),        # span, back to back, padding at the end
    ((1, 9, 14), 21),        # gaps between tensors
    ((10, 0, 16), 22),       # out of order
])
def test_bucket_copy_plan_copies_every_layout(offsets, length):
    from polynya.sync.manifest import BucketSpec
    from polynya.weights import BucketCopyPlan, FlatBuckets

    spec = BucketSpec(("a", "b", "c"), ((2, 3), (4,), (2, 3)), offsets, length)
    flat = torch.arange(float(spec.numel))
    weights = FlatBuckets([spec], [flat])
    params = _params()
    plan = BucketCopyPlan(weights.specs, params)
    torch._foreach_copy_(plan.dst, plan.sources(weights.flats))
    for name, piece in split_weight_pieces(weights, {n: p.shape for n, p in params.items()}):
        assert torch.equal(params[name], piece), name  # same values as the plain pieces
    assert plan.current()
    params["b"].data = torch.ones(4)
    assert not plan.current()  # a parameter moved: the plan is stale
    with pytest.raises(ValueError, match="elements"):
        plan.sources([flat[:-1]])


@pytest.mark.parametrize("spec_args, needle", [
    ((("a", "zz"), ((2, 3), (1,)), None, None), "unknown"),
    ((("a",), ((3, 2),), None, None), "shape"),
    ((("a", "b"), ((2, 3), (4,)), (0, 6), 9), "outside"),
])
def test_bucket_copy_plan_rejects_what_does_not_fit(spec_args, needle):
    from polynya.sync.manifest import BucketSpec
    from polynya.weights import BucketCopyPlan

    with pytest.raises(ValueError, match=needle):
        BucketCopyPlan([BucketSpec(*spec_args)], _params())


def test_non_finite_names_tensors_not_gaps():
    """Views of one flat storage are checked in one pass; NaN in an alignment gap between
    them is not a weight, inf inside one is (and only that one is named)."""
    from polynya.weights import non_finite

    flat = torch.randn(40, generator=torch.Generator().manual_seed(0))
    flat[10] = float("nan")  # a gap: no tensor covers element 10
    views = [("a", flat[0:10].view(2, 5)), ("b", flat[11:25]), ("c", flat[25:40])]
    assert non_finite(views) == []
    flat[30] = float("inf")
    assert non_finite(views) == ["c"]
    assert non_finite([("d", torch.tensor([1.0, float("nan")]).t()), ("e", torch.ones(3))]) == ["d"]
    assert non_finite([("f", torch.ones(4, 4).t())]) == []  # non-contiguous, checked on its own

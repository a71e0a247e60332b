"""``polynya.dynamo.fresh_function``: a copy compiles with a recompile budget of its own, which
is what keeps one configuration of the compiled FlexAttention (or one layer class's region) from
pushing another onto Dynamo's silent eager fallback."""
import pytest
import torch
from polynya.dynamo import fresh_function

DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16)


def scaled(x, bias=1, *, k=2):
    return x * k + bias


@pytest.fixture
def compiles():
    """Graphs compiled by a counting backend, with a recompile budget of 2 per code object."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        yield seen, backend
    torch._dynamo.reset()


def test_one_code_object_shares_its_budget_across_wrappers(compiles):
    """The failure being avoided: two torch.compile wrappers of one function stop compiling
    once the first has spent the budget; the third dtype silently runs eagerly."""
    seen, backend = compiles
    first, second = torch.compile(scaled, backend=backend), torch.compile(scaled, backend=backend)
    for dtype in DTYPES[:3]:
        first(torch.ones(3, dtype=dtype))
    assert len(seen) == 2
    out = second(torch.ones(3, dtype=DTYPES[3]))
    assert len(seen) == 2 and out.tolist() == [3, 3, 3]  # right answer, no graph: eager


def test_copies_compile_on_their_own_budget(compiles):
    seen, backend = compiles
    first = torch.compile(fresh_function(scaled), backend=backend)
    for dtype in DTYPES[:3]:
        first(torch.ones(3, dtype=dtype))
    assert len(seen) == 2
    second = torch.compile(fresh_function(scaled), backend=backend)
    for dtype in DTYPES[3:]:
        assert second(torch.ones(3, dtype=dtype)).tolist() == [3, 3, 3]
    assert len(seen) == 4


def test_a_copy_keeps_defaults_closure_and_name():
    offset = 5

    def closure(x, *, k=3):
        return x * k + offset

    for fn, want in ((scaled, 2 * 4 + 1), (closure, 3 * 4 + 5)):
        copy = fresh_function(fn)
        assert copy is not fn and copy.__code__ is not fn.__code__
        assert copy(4) == want and copy.__name__ == fn.__name__
        assert copy.__kwdefaults__ == fn.__kwdefaults__
        assert copy.__kwdefaults__ is not fn.__kwdefaults__  # not shared: editing one is local

"""Digests and NaN/inf checks of tensors in separate storages (polynya.kernels.digest.scatter)
and the checksum paths on them (``checksum_views``, ``scan_views``, ``non_finite_views``).

Random tensors, each its own allocation or a view of a shared one, of mixed dtypes and odd sizes
(on the 8-byte grid: read in place by the kernel; off it, non-contiguous or empty: torch on
the device): the plan's digests equal the torch reference bit for bit, its NaN/inf counts are
non-zero exactly where ``isfinite`` fails, the checksum equals ``checksum_named_tensors`` (the
one definition) and a changed value changes it with the cached plan; a whole model's worth of
tensors costs a bounded number of aten ops (the launches are not per tensor). The kernel path
runs under ``TRITON_INTERPRET=1`` in a child process on CPU and compiled on a GPU (``gpu``).
"""
import os
import sys

import pytest
import torch
from op_count import OpCount
from polynya.checksum import (
    checksum_named_tensors,
    checksum_views,
    non_finite_views,
    scan_views,
)
from polynya.kernels.digest import tensor_digest
from polynya.kernels.digest.scatter import ScatterPlan
from polynya.weights import check_pairs, non_finite
from triton_interp import check_under_interpreter, digest_kernels_on_cpu

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def random_named(device: str, count: int, seed: int, block: int) -> list[tuple[str, torch.Tensor]]:
    """``count`` named tensors: most their own allocation (sizes on the 8-byte grid, around and
    across ``block`` words), some off the grid (odd sizes), some views of one shared buffer
    (one at an odd offset), one transposed (not contiguous), one empty; dtypes mixed."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(40 * block, generator=g).to(device)
    out = []
    for k in range(count):
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (), generator=g))]
        kind = k % 9
        if kind == 3:
            t = torch.randn(int(torch.randint(1, 3 * block, (), generator=g)) * 8 + 3, generator=g)
        elif kind == 5:
            a = int(torch.randint(0, 30 * block, (), generator=g)) + (k % 2)
            t = shared[a:a + 8 * int(torch.randint(1, block, (), generator=g))]
            out.append((f"layers.{k}.shared", t))
            continue
        elif kind == 7:
            t = torch.randn(24, 40 + k, generator=g).t()
        else:
            words = [1, block, block + 1, 3 * block - 1][k % 4] if k < 12 else \
                int(torch.randint(1, 4 * block, (), generator=g))
            t = torch.randn(words * 8 // torch.empty((), dtype=dtype).element_size(), generator=g)
        out.append((f"layers.{k}.w", (t * 0.1).to(dtype).to(device) if kind != 7 else t.to(device)))
    out.append(("empty", torch.empty(0, dtype=torch.bfloat16, device=device)))
    return out


def check_scatter(device: str, count: int, block: int) -> None:
    items = random_named(device, count, seed=count, block=block)
    tensors = [t for _, t in items]
    plan = ScatterPlan(tensors)
    assert 0 < plan.fallback < len(items) // 3
    digests, bad = plan.scan(tensors, finite=True)
    assert digests.tolist() == [tensor_digest(t) for t in tensors]
    assert bad.tolist() == [0] * len(items)
    assert checksum_views(items) == checksum_named_tensors(items)
    assert scan_views(items) == (checksum_named_tensors(items), [])
    # NaN / inf in a tensor read in place, in one off the grid, in the non-contiguous one
    poisoned = {1: float("nan"), 3: float("inf"), 7: float("-inf"), 12: float("nan")}
    before = [t.clone() for t in tensors]
    for k, v in poisoned.items():
        if tensors[k].is_contiguous():
            tensors[k].view(-1)[k * 5 % tensors[k].numel()] = v
        else:
            tensors[k][0, 1] = v
    _, bad = plan.scan(tensors, digest=False, finite=True)
    assert [i for i, b in enumerate(bad.tolist()) if b] == sorted(poisoned)
    names = [items[k][0] for k in sorted(poisoned)]
    assert sorted(non_finite(items)) == sorted(names)
    fast = non_finite_views(items)  # None: not the kernel path, the caller uses torch
    assert (fast is None) == (not plan.kernel_ok()) and (fast is None or sorted(fast) == sorted(names))
    got, bad_names = scan_views(items)
    assert got == checksum_named_tensors(items) and sorted(bad_names) == sorted(names)
    with pytest.raises(ValueError, match="NaN or inf"):
        check_pairs(items)
    for t, b in zip(tensors, before):  # the checks wrote nothing
        t.copy_(b)
    base = checksum_views(items)
    for k in (0, 3, 7, len(items) - 2):  # one changed value changes the cached plan's checksum
        t = tensors[k]
        keep = t.clone()
        if t.is_contiguous():
            flat = t.view(-1)
            flat[-1] = flat[-1] * 2 + 1
        else:
            t[-1, -1] = t[-1, -1] * 2 + 1
        assert checksum_views(items) == checksum_named_tensors(items) != base, k
        t.copy_(keep)
    assert checksum_views(items) == base
    with pytest.raises(ValueError, match="do not lie where"):
        plan.scan([t.clone() for t in tensors])
    check_pairs(items, checksum=base)
    with pytest.raises(ValueError, match="checksum mismatch"):
        check_pairs(items, checksum="0" * 32)


def check_op_count(device: str, count: int, bound: int | None) -> None:
    """A model's worth of separately allocated tensors: a checksum, a checked load's checks and
    a NaN/inf check each cost as many aten ops for ``count`` tensors as for a tenth of them
    (the launches are not per tensor; under the interpreter each launch copies its arguments
    with a few ops), and at most ``bound`` on a GPU."""
    def ops_of(n: int) -> list[int]:
        g = torch.Generator().manual_seed(n)
        items = [(f"p{k}", (torch.randn(64 + 8 * k, generator=g)).to(torch.bfloat16).to(device))
                 for k in range(n)]
        want = checksum_named_tensors(items)
        assert checksum_views(items) == want  # builds and caches the layout
        counts = []
        for fn in (lambda: checksum_views(items), lambda: check_pairs(items, checksum=want),
                   lambda: non_finite(items)):
            with OpCount() as c:
                fn()
            counts.append(c.ops)
        return counts

    many, few = ops_of(count), ops_of(count // 10)
    assert many == few, (many, few)
    if bound is not None:
        assert max(many) <= bound, many


def test_reference_path():
    """Without the kernel (CPU): the same values through the torch path."""
    check_scatter("cpu", 30, 64)


def check_float8(device: str) -> None:
    """A float8 NaN / inf among the tensors is found by every check (kernel or torch path)."""
    g = torch.Generator().manual_seed(8)
    for dtype, bad_byte in ((torch.float8_e4m3fn, 0x7F), (torch.float8_e5m2, 0x7C),
                            (torch.float8_e4m3fnuz, 0x80)):
        w = (torch.randn(64, generator=g) / 4).to(dtype).to(device)
        items = [("w", w), ("v", torch.randn(16, generator=g).to(device))]
        want = checksum_named_tensors(items)
        assert scan_views(items) == (want, []) and non_finite(items) == []
        assert non_finite_views(items) in ([], None)  # None: not the kernel path, torch checks
        w.view(torch.uint8)[5] = bad_byte
        assert scan_views(items)[1] == ["w"] and non_finite(items) == ["w"], dtype
        assert non_finite_views(items) in (["w"], None)
        with pytest.raises(ValueError, match="w"):
            check_pairs(items, checksum=checksum_named_tensors(items))


def check_plan_guard(device: str) -> None:
    """A plan refuses tensors at its addresses that are not the ones it was made for (another
    dtype or a non-contiguous view of the same memory): it would read the wrong bytes."""
    buf = torch.randn(1024).to(device)
    a, b = buf[:24].view(4, 6), buf[512:520]
    plan = ScatterPlan([a, b])
    for wrong in ([a.t(), b], [a.view(torch.int32), b]):
        with pytest.raises(ValueError, match="make a new plan"):
            plan.scan(wrong)
    digests, _ = plan.scan([a, b])
    assert digests.tolist() == [tensor_digest(a), tensor_digest(b)]


def test_float8_and_plan_guard_reference_path():
    check_float8("cpu")
    check_plan_guard("cpu")


@pytest.mark.gpu
def test_plan_refuses_mixed_devices():
    with pytest.raises(ValueError, match="one device"):
        ScatterPlan([torch.zeros(8), torch.zeros(8, device="cuda")])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_kernel_under_interpreter():
    check_under_interpreter(__file__)


def _interp():
    from polynya.kernels.digest import op

    digest_kernels_on_cpu()
    check_scatter("cpu", 40, op.BLOCK)
    check_op_count("cpu", 310, None)
    check_float8("cpu")
    check_plan_guard("cpu")
    print("INTERP OK")


@pytest.mark.gpu
def test_kernel_on_gpu():
    check_scatter("cuda", 200, 4096)
    check_op_count("cuda", 310, 24)
    check_float8("cuda")
    check_plan_guard("cuda")


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp()

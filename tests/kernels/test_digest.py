"""The weight digest (polynya.kernels.digest): what it detects, and its paths agree bit for bit.

Detection is checked on fresh random weights for the corruptions a sync or a checkpoint can
suffer: a swap of two values (8191 apart too: the old ``sum bits * (pos % 8191 + 1)`` digest
accepted it), ``+k/-k`` pairs, a value moved (a run shifted by one), every single-bit flip of
an element; each test also shows the old digest is fooled by its case where it was, so the
tests can fail. Agreement: torch reference == a Python big-integer oracle == the Triton kernels
(under ``TRITON_INTERPRET=1`` in a child process on CPU; compiled on a GPU), for tensors on
the 8-byte grid (read as words in place) and off it (torch on the device).
"""
import os
import sys

import pytest
import torch
from triton_interp import run_under_interpreter

from polynya.checksum import checksum_named_tensors
from polynya.kernels.digest import DigestPlan, tensor_digest
from polynya.kernels.digest.reference import BITS, bits_view, digest_python, digest_reference


def old_digest(t: torch.Tensor) -> int:
    """The digest polynya used before (kept here only to show the cases below fooled it)."""
    bits = bits_view(t).to(torch.int64)
    pos = torch.arange(bits.numel(), dtype=torch.int64)
    return int((bits * (pos % 8191 + 1)).sum())


def weights(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.uint8, torch.int8])
def test_reference_equals_python_oracle(dtype):
    t = (torch.randn(777, generator=torch.Generator().manual_seed(1)) * 90).to(dtype)
    as_ints = [int(v) for v in bits_view(t).tolist()]
    assert tensor_digest(t) == digest_python(as_ints, t.element_size())
    assert tensor_digest(t.view(7, 111)) == tensor_digest(t)  # the shape is in the signature line
    assert digest_reference(bits_view(t)[:0]) == 0
    before = t.clone()
    tensor_digest(t)
    assert torch.equal(bits_view(t), bits_view(before))  # the digest never writes its input


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swaps_are_detected_8191_apart_too(dtype):
    x = weights(40000, dtype)
    g = torch.Generator().manual_seed(2)
    fooled_old = 0
    for trial in range(60):
        i = int(torch.randint(0, 40000 - 8191, (), generator=g))
        j = i + 8191 if trial % 2 == 0 else int(torch.randint(0, 40000, (), generator=g))
        if bits_view(x)[i] == bits_view(x)[j]:
            continue
        y = x.clone()
        y[i], y[j] = x[j], x[i]
        assert tensor_digest(y) != tensor_digest(x), (i, j)
        fooled_old += old_digest(y) == old_digest(x)
    assert fooled_old >= 25  # every swap 8191 apart fooled the old digest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plus_minus_k_pairs_are_detected(dtype):
    x = weights(30000, dtype, seed=3)
    bits = bits_view(x)
    g = torch.Generator().manual_seed(4)
    fooled_old = 0
    for _ in range(60):  # +k on the bits of one element, -k on another of equal old weight
        i = int(torch.randint(0, 30000 - 8191, (), generator=g))
        j = i + 8191
        k = int(torch.randint(1, 50, (), generator=g))
        y = bits.clone()
        y[i] += k
        y[j] -= k
        assert digest_reference(y) != digest_reference(bits)
        fooled_old += old_digest(y) == old_digest(bits)
    assert fooled_old == 60
    for _ in range(60):  # +k / -k in value space at random places
        i, j = (int(v) for v in torch.randint(0, 30000, (2,), generator=g))
        if i == j:
            continue
        y = x.clone()
        k = float(torch.rand((), generator=g)) * 0.01 + 1e-3
        y[i] += k
        y[j] -= k
        if torch.equal(bits_view(y), bits):
            continue
        assert tensor_digest(y) != tensor_digest(x)


def test_moved_values_are_detected():
    x = weights(20000, torch.bfloat16, seed=5)
    g = torch.Generator().manual_seed(6)
    for _ in range(40):
        a = int(torch.randint(0, 19000, (), generator=g))
        n = int(torch.randint(2, 900, (), generator=g))
        y = x.clone()
        y[a:a + n] = torch.roll(x[a:a + n], 1)  # one value moved to the front of a run
        if torch.equal(bits_view(y), bits_view(x)):
            continue
        assert tensor_digest(y) != tensor_digest(x)
    y = x.clone()
    y[100], y[101] = x[101], x[100]  # neighbours
    assert tensor_digest(y) != tensor_digest(x) or torch.equal(x[100], x[101])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_single_bit_flip_is_detected(dtype):
    x = weights(5000, dtype, seed=7)
    base = digest_reference(bits_view(x))
    g = torch.Generator().manual_seed(8)
    width = 8 * x.element_size()
    for i in torch.randint(0, 5000, (12,), generator=g).tolist():
        for bit in range(width):
            y = bits_view(x).clone()
            mask = 1 << bit if bit < width - 1 else -(1 << bit)  # the sign bit of the int view
            y[i] ^= mask
            assert digest_reference(y) != base, (i, bit)


def test_checksum_names_dtypes_shapes_and_order():
    a, b = weights(300, torch.float32, 9), weights(200, torch.float32, 10)
    base = checksum_named_tensors([("a", a), ("b", b)])
    assert checksum_named_tensors([("b", b), ("a", a)]) == base  # order-free
    a2 = a.clone()
    a2[17] += 1e-3
    assert checksum_named_tensors([("a", a2), ("b", b)]) != base
    assert checksum_named_tensors([("a", a.view(3, 100)), ("b", b)]) != base
    assert checksum_named_tensors([("a", a.double()), ("b", b)]) != base
    assert checksum_named_tensors([("b", a), ("a", b)]) != base  # names swapped


def test_plan_reference_matches_per_tensor():
    flat = weights(21000, torch.bfloat16, 11)
    starts, lens = [0, 4096, 4097, 11000, 20999], [4096, 1, 6903, 9999, 1]
    plan = DigestPlan([(starts, lens)])
    assert plan.digests([flat], kernel=False) == [tensor_digest(flat[s:s + n])
                                                 for s, n in zip(starts, lens)]
    with pytest.raises(ValueError, match="plan needs"):
        plan.digests([flat[:100]], kernel=False)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # triton's interpreter cannot loop to a loaded bound there
        pytest.skip("on a GPU the compiled kernels are checked by test_kernels_on_gpu")
    run_under_interpreter(__file__)


def check_kernel(device: str, n: int, starts, lens) -> None:
    """The Triton plan equals the reference on every element width, ragged tensors, several
    flats (groups) and a tensor spanning many blocks."""
    for i, dtype in enumerate((torch.bfloat16, torch.float32, torch.float16, torch.uint8,
                               torch.float64)):
        flat = (torch.randn(n, generator=torch.Generator().manual_seed(i)) * 100).to(dtype)
        flat = flat.to(device)
        other = flat[: n // 3].clone()
        plan = DigestPlan([(starts, lens), ([0, 5], [n // 3 - 5, 5])])
        got = plan.digests([flat, other], kernel=True)
        assert got == plan.reference([flat, other]), dtype
        assert flat.element_size() in BITS


def _interp():
    import polynya.kernels.digest.op as op

    op.RBLOCK = 4  # several iterations of the per-tensor sum
    op.BLOCK = 256  # several blocks (of 64-bit words) per tensor at interpreter sizes
    # tensors off the 8-byte grid (odd starts / sizes: torch on the device) and on it (kernel)
    check_kernel("cpu", 21000, [0, 4096, 4097, 11000, 20999], [4096, 1, 6903, 9999, 1])
    check_kernel("cpu", 21000, [0, 4096, 8200, 12000, 20000], [4096, 4000, 3792, 8000, 1000])
    print("INTERP OK")


@pytest.mark.gpu
def test_kernels_on_gpu():
    n = 3_000_017
    check_kernel("cuda", n, [0, 4096, 100_000, 1_000_001, 2_999_000],
                 [4096, 95_904, 900_001, 1_998_999, 1017])
    check_kernel("cuda", n, [0, 4096, 100_000, 1_000_000, 2_999_000],
                 [4096, 95_904, 900_000, 1_999_000, 1000])


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp()

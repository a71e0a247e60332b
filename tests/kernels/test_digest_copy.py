"""The fused copy + digest (polynya.kernels.digest.copy) and the verified bucket load on it.

Random flat buckets of many tensors of odd sizes (one block, one element, several blocks,
ragged tails, gaps between tensors) in bf16 / fp16 / fp32 buckets side by side: the kernel's
digests equal the torch reference bit for bit, its non-finite counts equal ``isfinite``'s, its
copies are bit-exact, and the same read gives both. ``VerifiedBucketCopy`` (what the native
sampler's ``load_weights`` runs for a sync) refuses a flipped bit, a swap, a moved value and a
NaN, and then leaves every destination unchanged. The kernel path runs under
``TRITON_INTERPRET=1`` in a child process on CPU and compiled on a GPU (``gpu`` marker).
"""
import functools
import os
import sys

import pytest
import torch
from polynya.checksum import checksum_named_tensors
from polynya.kernels.digest import tensor_digest
from polynya.kernels.digest.copy import CopyPlan
from polynya.kernels.digest.reference import bits_view
from polynya.verified_copy import VerifiedBucketCopy
from polynya.weights import BucketSpec
from triton_interp import check_under_interpreter, digest_kernels_on_cpu

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def layout(lens: list[int], seed: int, gaps: bool = True) -> tuple[list[int], int]:
    """Starts of ``lens`` in a flat buffer and the buffer size: each tensor starts on the
    8-element grid (random gaps of 0-24 elements) except one in seven, which starts one element
    off it (the kernel reads tensors on the grid, torch the others)."""
    g = torch.Generator().manual_seed(seed)
    starts, pos = [], 0
    for k, n in enumerate(lens):
        pos = -(-pos // 8) * 8
        if gaps:
            pos += 8 * int(torch.randint(0, 4, (), generator=g)) + (k % 7 == 3)
        starts.append(pos)
        pos += n
    return starts, pos + (3 if gaps else 0)


def random_lens(count: int, seed: int, block: int) -> list[int]:
    """Tensor sizes in elements: one 64-bit word, whole blocks of words for 2-byte elements and
    around them, odd sizes (off the 8-byte grid), and random multiples of 8."""
    g = torch.Generator().manual_seed(seed)
    edge = [1, 7, 8, 4 * block, 4 * block + 8, 8 * block - 8]
    rest = (torch.randint(1, 12 * block // 8, (count - len(edge),), generator=g) * 8).tolist()
    rest = [n + 3 if i % 5 == 4 else n for i, n in enumerate(rest)]
    lens = edge + rest
    return [lens[i] for i in torch.randperm(len(lens), generator=g).tolist()]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits_view(a), bits_view(b))


def check_plan(device: str, count: int, block: int, kernel: bool) -> None:
    """CopyPlan over one bucket per dtype: check / copy / copy+digest == the reference."""
    groups, flats, dsts = [], [], []
    for i, dtype in enumerate(DTYPES):
        lens = random_lens(count, 10 + i, block)
        starts, size = layout(lens, 20 + i)
        flat = (torch.randn(size, generator=torch.Generator().manual_seed(i)) * 3).to(dtype)
        flat[starts[2] + lens[2] // 2] = float("nan") if i != 1 else float("inf")
        flat[starts[-1]] = float("-inf")
        flat = flat.to(device)
        dst = [torch.full((n,), 7.0, dtype=dtype, device=device) for n in lens]
        groups.append((starts, lens, dst))
        flats.append(flat)
        dsts.append(dst)
    plan = CopyPlan(groups)
    assert plan.kernel_ok(flats, copy=True) == kernel
    if kernel:  # both paths inside the kernel path: words in place, and torch off the grid
        in_place, off_grid = plan.kernel_share(flats)
        assert in_place > 2 * off_grid > 0
    want_d = [tensor_digest(f[s:s + n]) for f, (st, ln, _) in zip(flats, groups)
              for s, n in zip(st, ln)]
    want_b = [int((~torch.isfinite(f[s:s + n])).sum()) for f, (st, ln, _) in zip(flats, groups)
              for s, n in zip(st, ln)]
    want_b = [n > 0 for n in want_b]  # the kernel counts words holding a NaN/inf
    d, b = plan.check(flats, kernel=kernel)
    assert d.tolist() == want_d and [n > 0 for n in b.tolist()] == want_b
    assert all(bool((t == 7).all()) for ds in dsts for t in ds)  # check writes nothing
    assert plan.copy(flats, kernel=kernel) is None
    for f, (st, ln, _), ds in zip(flats, groups, dsts):
        assert all(same_bits(t, f[s:s + n]) for t, s, n in zip(ds, st, ln))
    for ds in dsts:
        for t in ds:
            t.fill_(-1.0)
    d, b = plan.copy(flats, digest=True, kernel=kernel)
    assert d.tolist() == want_d and [n > 0 for n in b.tolist()] == want_b
    for f, (st, ln, _), ds in zip(flats, groups, dsts):
        assert all(same_bits(t, f[s:s + n]) for t, s, n in zip(ds, st, ln))


def refuses(plan, checksum, params, before, bad_flats, match) -> None:
    """``plan.load(bad_flats)`` raises ``match`` and leaves every parameter as ``before``."""
    with pytest.raises(ValueError, match=match):
        plan.load(bad_flats, checksum)
    assert all(same_bits(params[n], before[n]) for n in params), match


def check_verified_load(device: str, count: int, block: int) -> None:
    """A sync's buckets into parameters: accepted when equal to the sender's, refused (and the
    parameters untouched) on a flipped bit, a swap, a moved value, a NaN or a wrong bucket."""
    for i, dtype in enumerate(DTYPES):
        lens = random_lens(count, 30 + i, block)
        specs, flats = [], []
        for b, part in enumerate((lens[: count // 2], lens[count // 2:])):
            names = tuple(f"b{b}.w{k}" for k in range(len(part)))
            shapes = tuple((n,) if k % 2 else (1, n) for k, n in enumerate(part))
            if b == 0:  # packed bucket
                specs.append(BucketSpec(names, shapes))
                size = sum(part)
            else:  # span bucket with gaps
                starts, size = layout(part, 40 + i)
                specs.append(BucketSpec(names, shapes, tuple(starts), size))
            g = torch.Generator().manual_seed(50 + 2 * i + b)
            flats.append((torch.randn(size, generator=g)).to(dtype).to(device))
        params = {n: torch.zeros(s, dtype=dtype, device=device) for sp in specs
                  for n, s in zip(sp.names, sp.shapes)}
        pairs = [pair for sp, f in zip(specs, flats) for pair in sp.views(f)]
        checksum = checksum_named_tensors(pairs)
        plan = VerifiedBucketCopy(specs, params, dtype)
        assert plan.fits
        before = {n: p.clone() for n, p in params.items()}
        refused = functools.partial(refuses, plan, checksum, params, before)
        k0 = next(k for k, n in enumerate(specs[0].sizes()) if n >= 2 and k >= 2)
        k1 = next(k for k, n in enumerate(specs[1].sizes()) if n >= 2 and k >= 1)
        a, b = specs[0].starts()[k0], specs[1].starts()[k1]
        flipped = [f.clone() for f in flats]
        bits_view(flipped[0])[a + 1] ^= 1 << 3
        refused(flipped, "checksum mismatch")
        swapped = [f.clone() for f in flats]
        x, y = flats[1][b].clone(), flats[1][b + 1].clone()
        assert not same_bits(x, y)
        swapped[1][b], swapped[1][b + 1] = y, x
        refused(swapped, "checksum mismatch")
        moved = [f.clone() for f in flats]  # one tensor's values shifted by one position
        n3 = specs[0].sizes()[k0]
        moved[0][a + 1:a + n3] = flats[0][a:a + n3 - 1].clone()
        refused(moved, "checksum mismatch")
        nan = [f.clone() for f in flats]
        nan[1][b] = float("nan")
        refused(nan, "NaN or inf")
        refused([flats[0], flats[1][:-1]], "does not hold")
        refused([flats[0].float() if dtype != torch.float32 else flats[0].half(), flats[1]],
                "dtype")
        plan.load(flats, checksum)
        assert all(same_bits(p.view(-1), v.reshape(-1)) for n, p in params.items()
                   for m, v in pairs if m == n)


def check_lanes(dtype: torch.dtype) -> None:
    """A NaN or inf in any lane of a 64-bit word (and in the lone word of a 1-word tensor) is
    counted; finite extremes (max, min, subnormals, -0.0) are not."""
    info = torch.finfo(dtype)
    per_word = 8 // torch.empty((), dtype=dtype).element_size()
    finite = torch.tensor([info.max, -info.max, info.tiny / 4, -0.0, 1.0, info.min,
                           info.smallest_normal, 3.0], dtype=dtype)
    for lane in range(per_word):
        for value in (float("nan"), float("inf"), float("-inf")):
            if torch.isfinite(torch.tensor([value]).to(dtype).float()).all():
                continue  # float8_e4m3fn has no inf (the cast saturates to its max)
            flat = finite.clone()
            flat[lane] = value
            plan = CopyPlan([([0, per_word], [per_word, 8 - per_word], None)])
            _, bad = plan.check([flat], kernel=True)
            assert bad.tolist()[0] > 0 and bad.tolist()[1] == 0, (dtype, lane, value)
    _, bad = CopyPlan([([0], [8], None)]).check([finite], kernel=True)
    assert bad.tolist() == [0]


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def test_float8_non_finite_counted_on_the_torch_path():
    """float8 NaN / inf (e4m3fn: NaN only) are counted without the kernel, and a float8 dtype the
    kernel's test does not know (e4m3fnuz: NaN is the bit pattern of -0) never takes it."""
    for dtype, bad_bytes in ((torch.float8_e4m3fn, (0x7F, 0xFF)), (torch.float8_e5m2, (0x7C, 0xFE, 0x7F))):
        flat = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, -0.0, 448.0 if dtype == FLOAT8[0] else 57344.0, 0.25],
                            dtype=dtype)
        plan = CopyPlan([([0], [8], None)])
        assert plan.check([flat], kernel=False)[1].tolist() == [0]
        for b in bad_bytes:
            bad = flat.clone()
            bad.view(torch.uint8)[5] = b
            assert plan.check([bad], kernel=False)[1].tolist() == [1], (dtype, hex(b))
    fnuz = torch.zeros(8, dtype=torch.float8_e4m3fnuz)
    assert not CopyPlan([([0], [8], None)]).kernel_ok([fnuz], copy=False)


def test_reference_paths():
    check_plan("cpu", 9, 64, kernel=False)
    check_verified_load("cpu", 10, 64)


def test_plan_refuses_bad_layouts():
    with pytest.raises(ValueError, match="destination"):
        CopyPlan([([0, 4], [4, 4], [torch.zeros(4)])])
    with pytest.raises(ValueError, match="non-negative"):
        CopyPlan([([-1], [4], None)])
    plan = CopyPlan([([0, 4], [4, 4], None)])
    with pytest.raises(ValueError, match="plan needs 8"):
        plan.check([torch.zeros(7)])
    with pytest.raises(ValueError, match="no destinations"):
        plan.copy([torch.zeros(8)])
    params = {"a": torch.zeros(4), "b": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="given twice"):
        VerifiedBucketCopy([BucketSpec(("a", "a"), ((4,), (4,)))], params, torch.float32)
    with pytest.raises(ValueError, match="shape"):
        VerifiedBucketCopy([BucketSpec(("a", "b"), ((4,), (4,)))], params, torch.float32)
    with pytest.raises(ValueError, match="outside"):
        VerifiedBucketCopy([BucketSpec(("a",), ((4,),), (2,), 5)], params, torch.float32)
    assert not VerifiedBucketCopy([BucketSpec(("a",), ((4,),))], params, torch.bfloat16).fits


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_kernel_under_interpreter():
    check_under_interpreter(__file__)


def _interp():
    from polynya.kernels.digest import op

    digest_kernels_on_cpu()
    check_plan("cpu", 24, op.BLOCK, kernel=True)
    check_verified_load("cpu", 16, op.BLOCK)
    for dtype in DTYPES + FLOAT8:  # NaN / inf in every lane of a word are found
        check_lanes(dtype)
    print("INTERP OK")


@pytest.mark.gpu
def test_kernel_on_gpu():
    check_plan("cuda", 120, 4096, kernel=True)
    check_verified_load("cuda", 60, 4096)


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp()

"""The fused RMSNorm (polynya.kernels.norm) against Hugging Face's own module, forward and both
gradients, on fresh random inputs.

Oracle: ``Qwen3RMSNorm`` (Llama/Qwen2/Mistral/Qwen3-MoE carry the same code; ``fuse_model``
checks that per class). The torch reference is HF's op sequence, so on CPU it equals the module
bit for bit. The Triton kernels run under ``TRITON_INTERPRET=1`` in a child process on CPU and
compiled on a GPU (``gpu`` marker). Tolerances:

- float32: 2e-6 of the output's largest magnitude (forward, dx, dw). The kernels make every
  operation HF makes; only fp32 evaluation order (the row's sum of squares, ``dy*w . x``, the
  column sums of dw, the terms of dx) differs, which moves results by a few fp32 ulps.
- bfloat16 / float16: HF's module rounds at four points (the normalised row ``h``, ``w * h``,
  ``dy * w``, ``dx``); the kernels round at the same points, so a difference appears only where
  an fp32 value differing in its last bits (``rsqrt`` is not correctly rounded on a GPU, nor are
  sums in one order) moves a value across a rounding boundary. ``ulp`` is the dtype's spacing at
  1.0, applied at the element's magnitude (floored at 1e-3 of the largest):

  - ``y``: two ulps — a flip of ``h`` carried through ``w * h`` (up to ``|w| * spacing(h)``)
    plus the final rounding of ``y``;
  - ``dx``: one ulp — only its final rounding (its fp32 inputs ``dy * w`` are rounded
    identically);
  - ``dw``: one ulp of ``dw`` plus one of ``sum_rows |dy * h|`` — each flipped ``h`` moves one
    term of the column sum by ``|dy| * spacing(h)``, and a column sum of random signs can be far
    smaller than its terms.

  HF's own module with ``rsqrt`` moved by 1-8 fp32 ulps stays inside these bounds (at most 0.94,
  1.00 and 0.37 of them on the GPU shapes below) and breaks the one-ulp bound that used to be here
  for ``y`` (up to 1.8x) and ``dw`` (up to 52x). The largest error against the fp32 computation
  (no intermediate rounding) must stay at most 2x HF's own (STYLE.md).
"""
import os
import sys

import pytest
import torch
from polynya.kernels.norm import kernel_applies, rms_norm, rms_norm_reference

try:
    import triton
    import triton.language as tl
    from polynya.kernels.norm.kernel import _round
except ImportError:  # the reference tests still run; the Triton ones skip
    triton = None
from triton_interp import check_under_interpreter

EPS = 1e-6
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # spacing at 1.0


def hf_norm(h: int, weight: torch.Tensor):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    m = Qwen3RMSNorm(h, eps=EPS).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
    return m


def _inputs(shape, dtype, device, seed, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3 + 0.5).to(device=device, dtype=dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=w_dtype or dtype)
    out_dtype = torch.promote_types(dtype, w.dtype)
    dy = torch.randn(*shape, generator=g).to(device=device, dtype=out_dtype)
    return x, w, dy


def _run(fn, x, w, dy, x_grad=True, w_grad=True):
    x = x.detach().clone().requires_grad_(x_grad)
    w = w.detach().clone().requires_grad_(w_grad)
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _fused(x, w):
    return rms_norm(x, w, EPS)


def _hf_run(x, w, dy, x_grad=True, w_grad=True):
    x = x.detach().clone().requires_grad_(x_grad)
    m = hf_norm(w.shape[0], w.detach())
    m.weight.requires_grad_(w_grad)
    y = m(x)
    y.backward(dy)
    return y.detach(), x.grad, m.weight.grad


def _scale(t: torch.Tensor) -> float:
    return float(t.float().abs().max())


def assert_matches_hf(x, w, dy) -> None:
    """The fused path (its forward and both gradients) against HF's module on the same inputs
    (tolerances: module docstring)."""
    got = _run(_fused, x, w, dy)
    want = _hf_run(x, w, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape)
        assert torch.isfinite(a).all(), name
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        for name, a, b in zip(("y", "dx", "dw"), got, want):
            assert _scale(a - b) <= 2e-6 * _scale(b), (name, _scale(a - b) / _scale(b))
        return
    ulp = ULP[x.dtype]  # the precision HF rounds the normalised row (and dx) to
    ref = _hf_run(x.float(), w.float(), dy.float())  # HF's math without low-precision rounding
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    dw_terms = (dy.float() * h).abs().reshape(-1, x.shape[-1]).sum(0)
    ulps = {"y": 2.0, "dx": 1.0, "dw": 1.0}
    for name, a, b, r in zip(("y", "dx", "dw"), got, want, ref):
        diff = (a.float() - b.float()).abs()
        size = b.float().abs() + 1e-3 * _scale(b) + (dw_terms if name == "dw" else 0.0)
        bound = ulps[name] * ulp * size
        assert (diff <= bound).all(), (name, float((diff / bound).max()))
        ours, theirs = _scale(a.float() - r), _scale(b.float() - r)
        assert ours <= 2 * theirs, (name, ours, theirs)


def check_kernels(device: str) -> None:
    """Every case the kernels must get right, on ``device`` (CUDA, or CPU under the
    interpreter with ``KERNEL_ON_CPU``)."""
    big = device == "cuda"
    shapes = [(3, 5, 37), (2, 7, 4, 16), (600, 24), (1, 1, 8)]
    if big:
        shapes += [(8, 384, 1024), (8, 384, 16, 128), (3, 77, 3001), (2, 9, 8192)]
    seed = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in shapes:
            seed += 1
            x, w, dy = _inputs(shape, dtype, device, seed)
            assert kernel_applies(x, w)
            assert_matches_hf(x, w, dy)
    # mixed dtypes: HF promotes the output (bf16 activations, fp32 weight -> fp32)
    x, w, dy = _inputs((4, 9, 40), torch.bfloat16, device, 99, w_dtype=torch.float32)
    assert_matches_hf(x, w, dy)
    check_strides(device)
    check_strided_weight(device)
    check_partial_grads(device)
    check_empty(device)
    check_bf16_rounding(device)


def check_bf16_rounding(device: str) -> None:
    """The kernels' fp32 -> bf16 rounding (on the bits) equals torch's, specials included."""
    g = torch.Generator().manual_seed(5)
    special = [float("nan"), -float("nan"), float("inf"), -float("inf"), 3.3895e38, -3.3895e38,
               3.39e38, 1e-40, -1e-40, 0.0, -0.0, 1.00390625, 1.01171875]  # last two: exact ties
    x = torch.cat([torch.randn(2000, generator=g) * 1e3, torch.tensor(special)]).to(device)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _round_kernel[(1,)](x, y, x.numel(), BLOCK=4096)
    want = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    assert same.all(), x[~same]


def check_strides(device: str) -> None:
    """Non-contiguous inputs (row stride, a transpose, a column stride) and gradients give
    exactly what their contiguous copies give; the input is never written."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 10, 2 * 48, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (1 + 0.3 * torch.randn(48, generator=g)).to(device=device, dtype=torch.bfloat16)
    views = {"row stride": base[..., :48], "transpose": base[..., :48].transpose(0, 1),
             "column stride": base[..., ::2]}
    for name, x in views.items():
        assert not x.is_contiguous(), name
        dy = torch.randn(x.shape, generator=g).to(device=device, dtype=torch.bfloat16)
        before = base.clone()
        got = _run(_fused, x, w, dy)
        want = _run(_fused, x.contiguous(), w, dy.transpose(0, 1).contiguous().transpose(0, 1))
        for a, b in zip(got, want):
            assert torch.equal(a, b), name
        assert torch.equal(base, before), name
        assert_matches_hf(x, w, dy)


def check_strided_weight(device: str) -> None:
    """A weight that is a strided view (the kernels read it with unit stride) takes the
    reference path and gives what its contiguous copy gives."""
    x, w, dy = _inputs((6, 40), torch.float32, device, 21)
    wide = torch.stack([w, torch.full_like(w, 7.0)], dim=1).reshape(-1)
    strided = wide[::2]
    assert not strided.is_contiguous() and torch.equal(strided, w)
    assert not kernel_applies(x, strided)
    got, want = _run(_fused, x, strided, dy), _run(_fused, x, w, dy)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def check_partial_grads(device: str) -> None:
    """Frozen weight (no dw kernel work) or frozen input: the other gradient is unchanged."""
    x, w, dy = _inputs((5, 11, 40), torch.bfloat16, device, 3)
    full = _run(_fused, x, w, dy)
    only_x = _run(_fused, x, w, dy, w_grad=False)
    only_w = _run(_fused, x, w, dy, x_grad=False)
    assert only_x[2] is None and only_w[1] is None
    assert torch.equal(only_x[1], full[1]) and torch.equal(only_w[2], full[2])
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, EPS), full[0])


def check_empty(device: str) -> None:
    x, w, dy = _inputs((0, 3, 40), torch.bfloat16, device, 4)
    y, dx, dw = _run(_fused, x, w, dy)
    assert y.shape == x.shape and dx.shape == x.shape
    assert torch.equal(dw, torch.zeros_like(dw))


if triton is not None:
    @triton.jit
    def _round_kernel(X, Y, N, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(Y + o, _round(tl.load(X + o, mask=o < N), tl.bfloat16), mask=o < N)


# ------------------------------------------------------------------ CPU (reference path)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 6, 4, 16)])
def test_reference_is_hf_bit_for_bit(dtype, shape):
    x, w, dy = _inputs(shape, dtype, "cpu", 11)
    got = _run(lambda a, b: rms_norm_reference(a, b, EPS), x, w, dy)
    want = _hf_run(x, w, dy)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_cpu_tensors_take_the_reference(monkeypatch):
    from polynya.kernels.norm import op

    x, w, dy = _inputs((4, 33), torch.bfloat16, "cpu", 12)
    assert not kernel_applies(x, w)
    monkeypatch.setattr(op, "KERNEL_ON_CPU", True)
    assert kernel_applies(x, w) and not kernel_applies(x.double(), w.double())
    wide = torch.ones(op.MAX_H + 1, dtype=torch.bfloat16)
    assert not kernel_applies(wide[None], wide)  # wider than a program holds
    assert not kernel_applies(x, w.float().double())
    monkeypatch.setattr(op, "KERNEL_ON_CPU", False)
    for a, b in zip(_run(_fused, x, w, dy), _hf_run(x, w, dy)):
        assert torch.equal(a, b)
    assert not kernel_applies(x.double(), w.double())


def test_bad_inputs_are_refused():
    x, w, _ = _inputs((4, 32), torch.float32, "cpu", 13)
    with pytest.raises(ValueError, match=r"x \[\.\.\., H\] and weight \[H\]"):
        rms_norm(x, w[:31], EPS)
    with pytest.raises(ValueError, match=r"x \[\.\.\., H\] and weight \[H\]"):
        rms_norm(x, w.view(2, 16), EPS)
    with pytest.raises(ValueError, match="eps >= 0"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="eps >= 0"):
        rms_norm(x, w, None)


# ------------------------------------------------------------------ Triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_triton_kernels_under_interpreter():
    check_under_interpreter(__file__)


def _interp():
    from polynya.kernels.norm import op

    op.KERNEL_ON_CPU = True  # the Triton path for CPU tensors (2 "SMs": several dw partials)
    check_kernels("cpu")
    print("INTERP OK")


@pytest.mark.gpu
def test_kernels_on_gpu():
    check_kernels("cuda")


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp()

"""Varlen attention (``polynya.kernels.zorro.varlen``): the FlashAttention-2 varlen CUDA backend
against an fp64 block-diagonal oracle, under the bf16 rule (STYLE.md 6). GPU only; the CPU
reference is checked in ``tests/core/test_packed_naive.py``."""
import numpy as np
import pytest
import torch

from polynya.kernels.zorro import segment_bounds, varlen_attention, varlen_unsupported_reason

pytestmark = pytest.mark.gpu


def _block_causal(q, k, v, seg, scale):
    """SDPA under a dense block-diagonal causal mask (math backend), token-major in and out."""
    idx = torch.arange(q.shape[0], device=q.device)
    mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    t = (lambda x: x.transpose(0, 1))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=mask,
                                                               scale=scale, enable_gqa=True)
    return t(out)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 8, 128), (12, 4, 64), (8, 8, 72)])
def test_cuda_backend_bf16_rule(seed, dtype, heads, kv_heads, dim):
    """Ragged segments (lengths 1..700, padding segments between rows) vs the fp64 oracle:
    error at most 2x torch's own low-precision attention + a small floor, outputs and grads."""
    g = np.random.default_rng(seed)
    lens = g.integers(1, 700, size=9).tolist()
    row = sum(lens) + 37  # one row with 37 padding tokens at its end
    nodes = np.stack([np.cumsum([0] + lens[:-1]), np.cumsum(lens), np.cumsum(lens)], 1)
    bounds = segment_bounds(nodes, row, row)
    assert bounds[-2] == sum(lens) and bounds[-1] == row
    cu = torch.from_numpy(bounds).to("cuda", torch.int32)
    seg = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.from_numpy(np.diff(bounds))).cuda()
    torch.manual_seed(seed)
    q = torch.randn(row, heads, dim, device="cuda", dtype=torch.float64)
    k, v = (torch.randn(row, kv_heads, dim, device="cuda", dtype=torch.float64) for _ in range(2))
    do = torch.randn_like(q)
    scale = dim ** -0.5
    assert varlen_unsupported_reason(q.to(dtype), k.to(dtype)) is None
    results = []
    for fn, dt in ((_block_causal, torch.float64), (_block_causal, dtype),
                   (lambda q_, k_, v_, s, sc: varlen_attention(q_, k_, v_, cu, int(np.diff(bounds).max()), sc), dtype)):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        out = fn(*xs, seg, scale)
        out.backward(do.to(dt))
        results.append([out.double()] + [x.grad.double() for x in xs])
    for name, want, low, got in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(got).all(), name
        budget = 2 * (low - want).abs().max().item() + 1e-3 * want.abs().max().item()
        assert (got - want).abs().max().item() <= budget, (name, (got - want).abs().max().item(), budget)


def test_cuda_backend_refuses_fp32_with_a_clear_error():
    q = torch.randn(10, 4, 64, device="cuda")
    cu = torch.tensor([0, 4, 10], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        varlen_attention(q, q, q, cu, 6, 0.125, backend="cuda")

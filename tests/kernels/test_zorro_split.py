"""Split ZoRRo attention (polynya.kernels.zorro) against dense masked attention.

CPU: the reference backend (the same plan, per-call backward with the final output/LSE, combine
and gradient gathers as on the GPU) must equal plain attention under the ZoRRo visibility mask,
outputs and every gradient, on random forests (shared system prompts, duplicate responses,
several rows, padding, GQA). The Triton combine runs under ``TRITON_INTERPRET=1`` in a child
process. GPU: cuDNN + Triton against the fp32 reference (bf16 rule).
"""
import os
import random
import sys

import numpy as np
import pytest
import torch
from polynya.kernels.zorro import combine, plan_split, split_attention
from polynya.kernels.zorro.plan import LEAF_MULTIPLE, check_nodes
from polynya.kernels.zorro.reference import combine_reference
from polynya.zorro import pack_rows
from polynya.zorro.attention import dense_mask
from triton_interp import run_under_interpreter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "core"))
from batches import random_batch  # noqa: E402


def make_case(seed, hq=4, hkv=2, d=16, dtype=torch.float64, device="cpu", **kw):
    rng = random.Random(seed)
    opts = dict(groups=4, max_group=5, max_prompt=20, max_response=9) | kw
    batch = random_batch(rng, vocab=50, **opts)
    rows = pack_rows(batch, max_tokens_per_row=opts["groups"] * 40, pad_multiple=8)
    n = rows.input_ids.numel()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g, dtype=torch.float64).to(device, dtype)
               for h in (hq, hkv, hkv))
    real = rows.tin.reshape(-1) != torch.iinfo(torch.int32).max
    return rows, q, k, v, real


def masked_attention(q, k, v, rows, scale):
    """Plain attention under the ZoRRo dense mask, per packed row, fp64 autograd oracle."""
    mask = dense_mask(rows.tin, rows.tout)[:, 0].to(q.device)          # [R, L, L]
    r, length = mask.shape[:2]
    rep = q.shape[1] // k.shape[1]
    qs, ks, vs = (x.view(r, length, x.shape[1], -1) for x in (q, k, v))
    s = torch.einsum("rqhd,rkhd->rhqk", qs, ks.repeat_interleave(rep, 2)) * scale
    p = s.masked_fill(~mask[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("rhqk,rkhd->rqhd", p, vs.repeat_interleave(rep, 2)).reshape(q.shape)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (6, 1)])
def test_reference_backend_equals_masked_attention(seed, heads):
    rows, q, k, v, real = make_case(seed, *heads)
    plan = plan_split(rows.nodes, q.shape[0], "cpu")
    scale = 0.3
    do = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(seed)) * real[:, None, None]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = masked_attention(*leaves, rows, scale)
    want.backward(do)
    got_in = [x.clone().requires_grad_() for x in (q, k, v)]
    got = split_attention(*got_in, plan, scale, backend="reference")
    got.backward(do)
    torch.testing.assert_close(got[real], want[real], atol=1e-10, rtol=1e-10)
    assert not got[~real].any()  # padding: zeros, never NaN
    for a, b in zip(got_in, leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-10)


def test_plan_tables_on_a_hand_built_forest():
    # row: [sys 0..3) -> [q1 3..5) -> r 5..7, r 7..8 ; [q2 8..9) -> r 9..11 ] [solo 11..13] pad 13..16
    nodes = np.array([[0, 3, 11], [3, 5, 8], [5, 7, 7], [7, 8, 8], [8, 9, 11], [9, 11, 11],
                      [11, 13, 13]])
    plan = plan_split(nodes, 16, "cpu")
    assert plan.inner == [(0, 3, 11), (3, 5, 8), (8, 9, 11)]
    L = LEAF_MULTIPLE  # four leaves, each padded to one block of L slots
    assert plan.leaf_len == L and plan.leaf_index.numel() == 4 * L
    assert plan.leaf_index.view(4, L)[:, :3].tolist() == [[5, 6, 6], [7, 7, 7], [9, 10, 10], [11, 12, 12]]
    assert plan.leaf_valid.view(4, L).sum(1).tolist() == [2, 1, 2, 2]
    src, kv = plan.src.tolist(), plan.kv_src[:, 0].tolist()
    c = (lambda part, row: (part << 32) + row)  # parts: sys call, q1 call, q2 call, leaf batch
    assert src[0] == [0, -1, -1] and src[4] == [4, c(1, 1), -1]    # q1 token: sys call + q1 call
    assert src[6] == [6, c(1, 3), c(3, 1)]                          # response: + its leaf slot
    assert src[12] == [c(3, 3 * L + 1), -1, -1]                     # solo sample: leaf only
    assert src[14] == [-1, -1, -1]                                  # padding
    assert kv == [0, 1, 2, c(1, 0), c(1, 1), c(3, 0), c(3, 1), c(3, L), c(2, 0), c(3, 2 * L),
                  c(3, 2 * L + 1), c(3, 3 * L), c(3, 3 * L + 1), -1, -1, -1]


@pytest.mark.parametrize("bad", [np.zeros((0, 3)), np.array([[0, 2]]), np.array([[2, 2, 2]]),
                                 np.array([[0, 3, 2]]), np.array([[0, 2, 40]]), np.array([[-1, 2, 2]]),
                                 np.array([[0, 2, 6], [4, 5, 8]]),      # subtrees cross
                                 np.array([[0, 4, 8], [2, 3, 3]])])     # child inside parent's own tokens
def test_bad_node_tables_are_rejected(bad):
    with pytest.raises(ValueError):
        check_nodes(bad, 16)
    with pytest.raises(ValueError):
        plan_split(bad, 16, "cpu")


def test_bad_inputs_are_rejected():
    rows, q, k, v, _ = make_case(0)
    plan = plan_split(rows.nodes, q.shape[0], "cpu")
    for args in ((q[:-1], k[:-1], v[:-1]), (q, k, v[:, :1]), (q[None], k, v), (q[:, :3], k, v)):
        with pytest.raises(ValueError):
            split_attention(*args, plan, 1.0)
    with pytest.raises(ValueError, match="backend"):
        split_attention(q, k, v, plan, 1.0, backend="nope")
    with pytest.raises(ValueError, match="CUDA backend"):
        split_attention(q, k, v, plan, 1.0, backend="cuda")


def test_combine_reference_merges_exactly():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, 12, generator=g, dtype=torch.float64)   # [H, T, keys]
    vals = torch.randn(12, 3, 4, generator=g, dtype=torch.float64)
    cuts = [(0, 5), (5, 9), (9, 12)]
    parts, lses = [], []
    for a, b in cuts:  # every token's keys split in three partials
        s = full[:, :, a:b]
        lses.append(s.logsumexp(-1))
        parts.append(torch.einsum("htk,khd->thd", s.softmax(-1), vals[a:b]))
    src = torch.tensor([[(p << 32) + t for p in range(3)] for t in range(5)])
    src[4, 1:] = -1  # token 4 only has its first partial ...
    out, lse = combine_reference(parts, lses, src)
    want = torch.einsum("htk,khd->thd", full.softmax(-1), vals)
    torch.testing.assert_close(out[:4], want[:4])
    torch.testing.assert_close(lse[:, :4], full.logsumexp(-1)[:, :4])
    torch.testing.assert_close(out[4], parts[0][4])  # ... so it keeps exactly that one


def test_combine_rejects_bad_input():
    parts, lses, src = random_parts(torch.Generator().manual_seed(2), 2, 4, 2, 5, torch.float32)
    for bad in (([], lses, src), ([parts[0], parts[1][:, :1]], lses[:2], src),
                (parts, lses[:2], src), (parts, [x.T for x in lses], src),
                (parts, lses, src.int()), (parts, lses, src[:, 0])):
        with pytest.raises(ValueError):
            combine(*bad)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_triton_combine_under_interpreter():
    run_under_interpreter(__file__)


def _interp_combine():
    """Runs in the child (TRITON_INTERPRET=1): the Triton combine vs the reference, fp32."""
    from polynya.kernels.zorro import op
    from polynya.kernels.zorro.kernel import _combine_kernel  # noqa: F401  (imports under the interpreter)

    g = torch.Generator().manual_seed(1)
    for heads, dim, width in ((3, 12, 3), (4, 16, 1)):
        parts, lse, src = random_parts(g, heads, dim, width, tokens=9, dtype=torch.float32)
        for with_lse in (True, False):
            l_in = lse if with_lse else None
            want = combine_reference(parts, l_in, src)
            got = op._launch_combine(parts, l_in, src)
            torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
            if with_lse:
                torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    print("INTERP OK")


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_backend_bf16_rule(seed, dtype):
    """cuDNN + Triton vs the fp64 oracle: error at most 2x torch's own low-precision
    attention (the same masked math in ``dtype``) plus a small floor, outputs and gradients."""
    rows, q, k, v, real = make_case(seed, 16, 8, 128, dtype=torch.float64, device="cuda",
                                    groups=5, max_group=8, max_prompt=300, max_response=120)
    plan = plan_split(rows.nodes, q.shape[0], "cuda")
    scale = 128 ** -0.5
    real = real.to(q.device)
    do = torch.randn_like(q) * real[:, None, None]
    results = []
    for fn, dt in ((masked_attention, torch.float64), (masked_attention, dtype),
                   (lambda *a: split_attention(*a[:3], plan, scale), dtype)):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        out = fn(*xs, rows, scale) if fn is masked_attention else fn(*xs)
        out.backward(do.to(dt))
        results.append([out[real].double()] + [x.grad.double() for x in xs])
    for name, want, low, got in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(got).all(), name
        budget = 2 * (low - want).abs().max().item() + 1e-3 * want.abs().max().item()
        assert (got - want).abs().max().item() <= budget, name


def random_parts(g, heads, dim, width, tokens, dtype, device="cpu", sizes=(7, 20, 5)):
    """Parts of different lengths (one a strided view, as cuDNN returns them), their LSEs, and
    a random src table (some slots empty, token 0 with no partial at all)."""
    parts = [torch.randn(n, heads, dim, generator=g).to(device, dtype) for n in sizes]
    parts[1] = torch.randn(heads, sizes[1], dim, generator=g).to(device, dtype).transpose(0, 1)
    lses = [(torch.randn(heads, n, generator=g) * 3).to(device) for n in sizes]
    part = torch.randint(0, len(sizes), (tokens, width), generator=g)
    row = (torch.rand(tokens, width, generator=g) * torch.tensor(sizes)[part]).long()
    src = torch.where(torch.rand(tokens, width, generator=g) < 0.2, -1, (part << 32) + row)
    src[0] = -1
    return parts, lses, src.to(device)


@pytest.mark.gpu
def test_triton_combine_on_gpu():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        parts, lse, src = random_parts(g, 14, 96, 3, 3000, dtype, "cuda", sizes=(5000, 700, 3000))
        for l_in in (lse, None):
            want = combine_reference(parts, l_in, src)
            got = combine(parts, l_in, src)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got[0].float(), want[0].float(), atol=tol, rtol=tol)
            if l_in is not None:
                torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp_combine()

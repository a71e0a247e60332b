"""eager_attention (the soft-cap / dense-mask fallback) against a direct computation."""
import pytest
import torch

import polynya.eager_attention as ea


@pytest.mark.parametrize("softcap,window", [(None, None), (0.9, None), (1.5, 4)])
def test_chunked_equals_direct_with_gradients(monkeypatch, softcap, window):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 6, 11, 8, generator=g) * 2).requires_grad_()
    k, v = (torch.randn(2, 3, 15, 8, generator=g).requires_grad_() for _ in range(2))
    mask = ea.causal_mask(11, 15, "cpu", window)[None, None]
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) * 0.4
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    ref = s.masked_fill(~mask, float("-inf")).softmax(-1) @ vv
    grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for chunk in (None, 2 * 6 * 15 * 3):  # one chunk, and chunks of 3 queries
        if chunk:
            monkeypatch.setattr(ea, "SCORES_PER_CHUNK", chunk)
        out = ea.eager_attention(q, k, v, mask, 0.4, softcap)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for a, b in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), grads):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_causal_mask_is_bottom_right_aligned_with_window():
    m = ea.causal_mask(2, 5, "cpu", 3)
    assert m.tolist() == [[False, True, True, True, False], [False, False, True, True, True]]
    assert ea.causal_mask(3, 3, "cpu").tolist() == torch.ones(3, 3).tril().bool().tolist()

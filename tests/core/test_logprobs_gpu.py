"""The ZoRRo == naive equivalence on the GPU (FlexAttention block masks, split cuDNN calls,
FlashAttention-2 varlen for the packed naive layout), fp32 and bf16."""
import random

import pytest
import torch

from polynya import compute_logprobs
from polynya.models import load_model

from .batches import random_batch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def always_zorro(monkeypatch):
    """These tests check the ZoRRo kernels on small batches: keep ``zorro=True`` on ZoRRo (the
    size rule that sends small batches to the packed layout is tested in test_logprobs_layout)."""
    import polynya.logprobs

    monkeypatch.setattr(polynya.logprobs, "ZORRO_MIN_WORK", 0)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("family", ["tiny:qwen3", "tiny:llama", "tiny:qwen3-moe"])
def test_zorro_equals_naive_fp32_cuda(family, layout):
    rng = random.Random(11)
    model = load_model(family, seed=3, device="cuda")
    batch = random_batch(rng, model.config.vocab_size, groups=6, max_group=8, max_prompt=200, max_response=70)
    naive = dict(zorro=False, naive_layout=layout)
    n = compute_logprobs(model, batch, entropy=True, **naive)
    z = compute_logprobs(model, batch, zorro=True, entropy=True, max_tokens_per_row=700)
    torch.testing.assert_close(z.logprobs, n.logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(z.entropy, n.entropy, atol=2e-5, rtol=0)
    grads = []
    for kw in (naive, dict(zorro=True)):
        model.zero_grad(set_to_none=True)
        compute_logprobs(model, batch, **kw).logprobs.sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    for k, g in grads[0].items():
        assert (grads[1][k] - g).norm() / g.norm().clamp_min(1e-12) < 1e-4, k


def test_packed_naive_bf16_takes_varlen_within_the_bf16_rule(monkeypatch):
    """bf16 packed naive (FlashAttention-2 varlen in one row and in budgeted rows, cuDNN over the
    padded samples, auto) vs an fp32 padded reference: log-probs, entropy and parameter
    gradients no further off than bf16 padded naive (torch's own SDPA) is, plus a floor; and the
    varlen kernel really ran, in every layer of the runs that force it."""
    import polynya.zorro.attention as attn

    calls = []
    real = attn.varlen_attention
    monkeypatch.setattr(attn, "varlen_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = random.Random(8)
    ref = load_model("random:qwen3-0.6b", num_hidden_layers=2, device="cuda")
    low = load_model("random:qwen3-0.6b", num_hidden_layers=2, device="cuda", dtype="bfloat16")
    batch = random_batch(rng, 151936, groups=3, max_group=8, max_prompt=600, max_response=300)
    packed = dict(naive_layout="packed")
    runs = ((ref, dict(naive_layout="padded")), (low, dict(naive_layout="padded")),
            (low, dict(packed, zorro_attention="varlen")),
            (low, dict(packed, zorro_attention="varlen", max_tokens_per_row=2000)),
            (low, dict(packed, zorro_attention="split")), (low, packed))
    stats, grads = [], []
    for model, kw in runs:
        model.zero_grad(set_to_none=True)
        st = compute_logprobs(model, batch, zorro=False, entropy=True, **kw)
        (st.logprobs * st.mask).sum().backward()
        stats.append(st)
        grads.append({k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None})
    assert len(calls) >= 2 * 2  # two forced runs x two layers (+ auto's if it picks varlen)
    r, n = stats[:2]
    for got, g_got in zip(stats[2:], grads[2:]):
        for field in ("logprobs", "entropy"):
            a, b, c = (getattr(s, field)[r.mask].float() for s in (r, n, got))
            assert torch.isfinite(c).all()
            assert (c - a).abs().max() <= 2 * (b - a).abs().max() + 1e-3, field
        for k, g in grads[0].items():
            err_low = (grads[1][k] - g).norm() / g.norm()
            err_p = (g_got[k] - g).norm() / g.norm()
            assert err_p <= 2 * err_low + 1e-3, (k, err_p.item(), err_low.item())


@pytest.mark.parametrize("attention", ["split", "flex"])
def test_zorro_bf16_rule_on_qwen3_0_6b_shape(attention):
    """bf16 ZoRRo (each GPU attention path) vs an fp32 naive reference: log-probs, entropy and
    parameter gradients no further off than bf16 naive is (STYLE.md's rule), plus a floor."""
    rng = random.Random(5)
    ref = load_model("random:qwen3-0.6b", num_hidden_layers=2, device="cuda")
    low = load_model("random:qwen3-0.6b", num_hidden_layers=2, device="cuda", dtype="bfloat16")
    batch = random_batch(rng, 151936, groups=3, max_group=8, max_prompt=600, max_response=300)
    runs = ((ref, dict(zorro=False)), (low, dict(zorro=False)),
            (low, dict(zorro=True, zorro_attention=attention)))
    stats, grads = [], []
    for model, kw in runs:
        model.zero_grad(set_to_none=True)
        st = compute_logprobs(model, batch, entropy=True, **kw)
        (st.logprobs * st.mask).sum().backward()
        stats.append(st)
        grads.append({k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None})
    r, n, z = stats
    for field in ("logprobs", "entropy"):
        a, b, c = (getattr(s, field)[r.mask].float() for s in (r, n, z))
        assert torch.isfinite(c).all()
        assert (c - a).abs().max() <= 2 * (b - a).abs().max() + 1e-3, field
    for k, g in grads[0].items():
        err_low = (grads[1][k] - g).norm() / g.norm()
        err_z = (grads[2][k] - g).norm() / g.norm()
        assert err_z <= 2 * err_low + 1e-3, (k, err_z.item(), err_low.item())


def test_split_attention_refuses_fp32_with_a_clear_error():
    model = load_model("tiny:qwen3", seed=1, device="cuda")
    batch = random_batch(random.Random(0), model.config.vocab_size, groups=2)
    with pytest.raises(ValueError, match="float32"):
        compute_logprobs(model, batch, zorro_attention="split")
    auto = compute_logprobs(model, batch)  # auto: FlexAttention for fp32
    flex = compute_logprobs(model, batch, zorro_attention="flex")
    torch.testing.assert_close(auto.logprobs, flex.logprobs)

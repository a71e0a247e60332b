"""The ZoRRo == naive equivalence on the GPU (FlexAttention block masks), fp32 and bf16."""
import random

import pytest
import torch

from polynya import compute_logprobs
from polynya.models import load_model

from .batches import random_batch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["tiny:qwen3", "tiny:llama", "tiny:qwen3-moe"])
def test_zorro_equals_naive_fp32_cuda(family):
    rng = random.Random(11)
    model = load_model(family, seed=3, device="cuda")
    batch = random_batch(rng, model.config.vocab_size, groups=6, max_group=8, max_prompt=200, max_response=70)
    n = compute_logprobs(model, batch, zorro=False, entropy=True)
    z = compute_logprobs(model, batch, zorro=True, entropy=True, max_tokens_per_row=700)
    torch.testing.assert_close(z.logprobs, n.logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(z.entropy, n.entropy, atol=2e-5, rtol=0)
    grads = []
    for zorro in (False, True):
        model.zero_grad(set_to_none=True)
        compute_logprobs(model, batch, zorro=zorro).logprobs.sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    for k, g in grads[0].items():
        assert (grads[1][k] - g).norm() / g.norm().clamp_min(1e-12) < 1e-4, k


@pytest.mark.parametrize("layers", [2])
def test_zorro_bf16_rule_on_qwen3_0_6b_shape(layers):
    rng = random.Random(5)
    ref = load_model("random:qwen3-0.6b", num_hidden_layers=layers, device="cuda")
    low = load_model("random:qwen3-0.6b", num_hidden_layers=layers, device="cuda", dtype="bfloat16")
    batch = random_batch(rng, 151936, groups=3, max_group=8, max_prompt=600, max_response=300)
    r = compute_logprobs(ref, batch, zorro=False, entropy=True)
    n = compute_logprobs(low, batch, zorro=False, entropy=True)
    z = compute_logprobs(low, batch, zorro=True, entropy=True)
    for field in ("logprobs", "entropy"):
        a, b, c = (getattr(s, field)[r.mask] for s in (r, n, z))
        assert torch.isfinite(c).all()
        assert (c - a).abs().max() <= 2 * (b - a).abs().max() + 1e-3, field

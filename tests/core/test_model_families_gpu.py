"""The model-family matrix on the GPU (written to spec; run with ``-m gpu`` on a CUDA machine).

fp32: ZoRRo (FlexAttention with windowed ``mask_mod`` / soft-cap ``score_mod``) == transformers'
eager naive path, 2e-5. bf16: ZoRRo through each GPU path (``split`` for full-attention layers
— windowed and soft-capped layers always take FlexAttention — and ``flex``) against an fp32
eager reference, no further off than bf16 eager naive is (STYLE.md's rule, as in
``test_logprobs_gpu.py``); the packed naive layout (``zorro=False, naive_layout="packed"``:
FlashAttention-2 varlen for full-attention layers, FlexAttention for windowed / soft-capped
ones) under the same two checks. Windows are widened past FlexAttention's 128-token blocks so that
full, partial and skipped blocks all occur.
"""
import random

import pytest
import torch
from polynya import RolloutBatch, compute_logprobs
from polynya.models import load_model

from .test_model_families import REFUSED, ZORRO_FAMILIES

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def always_zorro(monkeypatch):
    """These tests check the ZoRRo kernels on small batches: keep ``zorro=True`` on ZoRRo (the
    size rule that sends small batches to the packed layout is tested in test_logprobs_layout)."""
    import polynya.logprobs

    monkeypatch.setattr(polynya.logprobs, "ZORRO_MIN_WORK", 0)
WINDOW = 160
WINDOWED = {"mistral", "gemma2", "gemma3", "phi3", "qwen2-window"}


def _load(family, dtype, attn=None):
    kw = {"sliding_window": WINDOW} if family in WINDOWED else {}
    return load_model(f"tiny:{family}", seed=4, device="cuda", dtype=dtype,
                      attn_implementation=attn, **kw)


def long_batch(seed: int, vocab: int) -> RolloutBatch:
    """Groups behind a system prompt of 300 tokens (> WINDOW), responses up to 250 tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(2, vocab) for _ in range(300)]
    prompts, responses = [], []
    for g in range(4):
        q = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 120))]
        for _ in range(rng.randint(2, 6)):
            prompts.append(q if g == 3 else system + q)
            responses.append([rng.randrange(2, vocab) for _ in range(rng.randint(1, 250))])
    return RolloutBatch(prompts, responses)


def _run(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    st = compute_logprobs(model, batch, entropy=True, **kw)
    (st.logprobs * st.mask).sum().backward()
    return st, {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ZORRO_FAMILIES)
def test_zorro_equals_eager_fp32_cuda(family):
    ref, model = _load(family, "float32", "eager"), _load(family, "float32")
    batch = long_batch(1, model.config.vocab_size)
    n, gn = _run(ref, batch, zorro=False, naive_layout="padded")
    for kw in (dict(zorro=True, max_tokens_per_row=1500), dict(zorro=False, naive_layout="packed")):
        z, gz = _run(model, batch, **kw)
        torch.testing.assert_close(z.logprobs, n.logprobs, atol=2e-5, rtol=0)
        torch.testing.assert_close(z.entropy, n.entropy, atol=2e-5, rtol=0)
        for k, g in gn.items():
            assert (gz[k] - g).norm() / g.norm().clamp_min(1e-12) < 1e-4, (kw, k)


@pytest.mark.parametrize("attention", ["split", "flex", "packed naive"])
@pytest.mark.parametrize("family", ZORRO_FAMILIES)
def test_zorro_bf16_rule(family, attention):
    ref, low_naive, low = (_load(family, "float32", "eager"), _load(family, "bfloat16", "eager"),
                           _load(family, "bfloat16"))
    batch = long_batch(2, ref.config.vocab_size)
    kw = (dict(zorro=False, naive_layout="packed") if attention == "packed naive"
          else dict(zorro=True, zorro_attention=attention))
    runs = [_run(ref, batch, zorro=False, naive_layout="padded"),
            _run(low_naive, batch, zorro=False, naive_layout="padded"), _run(low, batch, **kw)]
    (r, gr), (n, gn), (z, gz) = runs
    for field in ("logprobs", "entropy"):
        a, b, c = (getattr(s, field)[r.mask].float() for s in (r, n, z))
        assert torch.isfinite(c).all()
        assert (c - a).abs().max() <= 2 * (b - a).abs().max() + 1e-3, (family, field)
    for k, g in gr.items():
        err_low = (gn[k] - g).norm() / g.norm()
        err_z = (gz[k] - g).norm() / g.norm()
        assert err_z <= 2 * err_low + 1e-3, (family, k, err_z.item(), err_low.item())


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refusal_on_cuda(family):
    model = _load(family, "bfloat16")
    with pytest.raises(ValueError) as err:
        compute_logprobs(model, long_batch(3, model.config.vocab_size))
    assert str(err.value) == REFUSED[family]

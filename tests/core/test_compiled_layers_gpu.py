"""``polynya.compiled_layers`` on the GPU (Inductor): a compiled model's log-probs, entropy and
parameter gradients, with gradient checkpointing, against an fp32 reference — fp32 compiled
within 1e-4 of eager fp32; bf16 compiled no further off than bf16 eager is, plus a floor — for
every attention path ZoRRo and the packed naive layout take (FlashAttention-2 varlen, split
cuDNN, FlexAttention), on ragged batches whose lengths change every call."""
import copy
import random

import pytest
import torch
from polynya import compute_logprobs
from polynya.compiled_layers import compile_layers
from polynya.models import load_model

from .batches import random_batch

pytestmark = pytest.mark.gpu


def _ckpt(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _stats(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    st = compute_logprobs(model, batch, entropy=True, **kw)
    ((st.logprobs * st.mask).sum() + 0.1 * (st.entropy * st.mask).sum()).backward()
    return st, {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None}


def test_compiled_fp32_equals_eager(monkeypatch):
    import polynya.logprobs

    monkeypatch.setattr(polynya.logprobs, "ZORRO_MIN_WORK", 0)  # small batches keep ZoRRo (flex)
    rng = random.Random(3)
    eager = _ckpt(load_model("tiny:qwen3", seed=1, device="cuda"))
    compiled = _ckpt(copy.deepcopy(eager))
    compile_layers(compiled)
    for i in range(3):
        batch = random_batch(rng, eager.config.vocab_size, groups=3, max_group=6, max_prompt=150,
                             max_response=60)
        for kw in (dict(zorro=True), dict(zorro=False)):
            (a, ga), (b, gb) = _stats(eager, batch, **kw), _stats(compiled, batch, **kw)
            torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
            torch.testing.assert_close(b.entropy, a.entropy, atol=1e-4, rtol=0)
            for k, g in ga.items():
                assert (gb[k] - g).norm() / g.norm().clamp_min(1e-12) < 1e-3, (i, kw, k)


@pytest.mark.parametrize("attention", ["varlen", "split", "flex"])
def test_compiled_bf16_within_the_bf16_rule(monkeypatch, attention):
    import polynya.logprobs

    monkeypatch.setattr(polynya.logprobs, "ZORRO_MIN_WORK", 0)
    rng = random.Random(17)
    ref = _ckpt(load_model("random:qwen3-0.6b", num_hidden_layers=2, device="cuda"))
    eager = _ckpt(load_model("random:qwen3-0.6b", num_hidden_layers=2, device="cuda", dtype="bfloat16"))
    compiled = _ckpt(copy.deepcopy(eager))
    assert len(compile_layers(compiled)) == 2  # the two decoder layers
    kw = dict(zorro=False, naive_layout="packed") if attention == "varlen" else dict(zorro=True)
    for i in range(2):  # two batches of other lengths: the dynamic graph serves both
        batch = random_batch(rng, 151936, groups=2, max_group=8, max_prompt=700, max_response=200)
        r, gr = _stats(ref, batch, zorro=False, naive_layout="padded")  # fp32 reference
        (n, gn), (c, gc) = (_stats(m, batch, zorro_attention=attention, **kw) for m in (eager, compiled))
        for field in ("logprobs", "entropy"):
            a, b, x = (getattr(s, field)[r.mask].float() for s in (r, n, c))
            assert torch.isfinite(x).all()
            assert (x - a).abs().max() <= 2 * (b - a).abs().max() + 1e-3, (i, field)
        for k, g in gr.items():
            err_eager = (gn[k] - g).norm() / g.norm()
            err_comp = (gc[k] - g).norm() / g.norm()
            assert err_comp <= 2 * err_eager + 1e-3, (i, k, float(err_comp), float(err_eager))

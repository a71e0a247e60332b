"""ZoRRo vs the naive path on fresh random tiny models and batches (fp32 exact, bf16 by rule)."""
import math
import random

import pytest
import torch

import polynya
from polynya import RolloutBatch, compute_logprobs
from polynya.head import token_stats
from polynya.models import load_model

from .batches import random_batch

FAMILIES = ["tiny:qwen3", "tiny:llama", "tiny:qwen3-moe"]


def _grads(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    stats = compute_logprobs(model, batch, entropy=True, **kw)
    w = torch.linspace(-1, 1, stats.logprobs.numel()).view_as(stats.logprobs)  # non-uniform upstream grad
    ((stats.logprobs * w).sum() + 0.3 * (stats.entropy * stats.mask).sum()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_zorro_equals_naive_fp32(family, seed):
    rng = random.Random(seed)
    model = load_model(family, seed=seed + 10)
    batch = random_batch(rng, model.config.vocab_size, groups=5, max_group=8)
    naive = compute_logprobs(model, batch, zorro=False, entropy=True)
    for budget in (None, 64):
        z = compute_logprobs(model, batch, zorro=True, entropy=True, max_tokens_per_row=budget, chunk_size=13)
        assert torch.equal(z.mask, naive.mask)
        torch.testing.assert_close(z.logprobs, naive.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(z.entropy, naive.entropy, atol=1e-5, rtol=0)
        assert (z.logprobs[~z.mask] == 0).all()
    g_naive = _grads(model, batch, zorro=False)
    g_zorro = _grads(model, batch, zorro=True, max_tokens_per_row=64, chunk_size=13)
    assert g_naive.keys() == g_zorro.keys() and len(g_naive) > 0
    for name, g in g_naive.items():
        rel = (g_zorro[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert rel < 1e-4, f"{name}: relative grad error {rel:.2e}"


@pytest.mark.parametrize("group_size", [1, 2, 3, 5, 8])
def test_first_response_token_uses_the_shared_last_prompt_position(group_size):
    """Every member's first token is predicted by the one shared last-prompt hidden state."""
    model = load_model("tiny:qwen3", seed=group_size)
    prompt = [7, 8, 9, 10]
    responses = [[11 + k, 3, 4] for k in range(group_size)]
    batch = RolloutBatch([prompt] * group_size, responses)
    z = compute_logprobs(model, batch, zorro=True)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    assert torch.allclose(z.logprobs[:, 0], logits[[r[0] for r in responses]], atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_error_within_twice_torch_bf16_error(family):
    rng = random.Random(7)
    ref_model = load_model(family, seed=5)
    bf16_model = load_model(family, seed=5, dtype="bfloat16")
    batch = random_batch(rng, ref_model.config.vocab_size, groups=4, max_group=6)
    ref = compute_logprobs(ref_model, batch, zorro=False, naive_layout="padded", entropy=True)
    naive = compute_logprobs(bf16_model, batch, zorro=False, naive_layout="padded", entropy=True)
    z = compute_logprobs(bf16_model, batch, zorro=True, entropy=True)
    packed = compute_logprobs(bf16_model, batch, zorro=False, naive_layout="packed", entropy=True)
    for field in ("logprobs", "entropy"):
        r, n, c, p = (getattr(s, field)[ref.mask] for s in (ref, naive, z, packed))
        assert torch.isfinite(c).all() and torch.isfinite(p).all()
        assert (c - r).abs().max() <= 2 * (n - r).abs().max() + 1e-3, field
        assert (p - r).abs().max() <= 2 * (n - r).abs().max() + 1e-3, field


def test_temperature_is_applied_per_call():
    model = load_model("tiny:llama", seed=2)
    batch = RolloutBatch([[5, 6, 7]] * 2, [[8, 9], [10]])
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    for t in (0.5, 1.0, 2.0):
        z = compute_logprobs(model, batch, temperature=t, entropy=True)
        lp = (logits / t).log_softmax(-1)
        assert torch.allclose(z.logprobs[0], torch.stack([lp[2, 8], lp[3, 9]]), atol=1e-5)
        p = lp.exp()
        assert torch.allclose(z.entropy[0, 0], -(p[2] * lp[2]).sum(), atol=1e-5)


class _WrappedHead(torch.nn.Module):
    """Not a plain nn.Linear: forces token_stats onto its module-call (checkpoint) path."""

    def __init__(self, linear):
        super().__init__()
        self.inner = linear
        self.weight = linear.weight

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_paths_match_dense_autograd(bias, temperature):
    torch.manual_seed(int(bias) + int(temperature * 10))
    head = torch.nn.Linear(24, 97, bias=bias)
    hidden = torch.randn(53, 24, requires_grad=True)
    target = torch.randint(0, 97, (53,))
    g1, g2 = torch.randn(53), torch.randn(53)

    def grads(fn):
        for t in (hidden, *head.parameters()):
            t.grad = None
        lp, ent = fn()
        ((lp * g1).sum() + (ent * g2).sum()).backward()
        return lp.detach(), ent.detach(), [t.grad.clone() for t in (hidden, *head.parameters())]

    def dense():
        z = head(hidden).float() / temperature
        logp = z.log_softmax(-1)
        return logp.gather(-1, target[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    ref = grads(dense)
    for h in (head, _WrappedHead(head)):
        got = grads(lambda: token_stats(h, hidden, target, temperature=temperature, entropy=True, chunk_size=7))
        torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0)
        for a, b in zip(got[2], ref[2]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_chunked_head_never_saves_full_logits():
    model = load_model("tiny:qwen3", seed=0)
    vocab = model.config.vocab_size
    hidden = torch.randn(100, model.config.hidden_size, requires_grad=True)
    target = torch.randint(0, vocab, (100,))
    for head in (model.get_output_embeddings(), _WrappedHead(model.get_output_embeddings())):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = token_stats(head, hidden, target, entropy=True, chunk_size=10)
        assert not [s for s in shapes if s[-1:] == (vocab,) and s[0] > 10], shapes
        (lp.sum() + ent.sum()).backward()
        ref_lp = head(hidden).float().log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)
        assert torch.allclose(lp, ref_lp, atol=1e-5)


def test_empty_responses_and_inference_mode():
    model = load_model("tiny:qwen3", seed=0)
    batch = RolloutBatch([[3, 4], [3, 4], [5]], [[], [6, 7], []])
    with torch.no_grad():
        z = compute_logprobs(model, batch, entropy=True)
        n = compute_logprobs(model, batch, zorro=False, entropy=True)
    assert z.logprobs.shape == (3, 2) and z.mask.sum() == 2
    assert torch.allclose(z.logprobs, n.logprobs, atol=1e-5)
    assert not z.logprobs.requires_grad


@pytest.mark.parametrize("kwargs, needle", [
    (dict(batch=RolloutBatch([[1, 2]], [[600]])), ">= vocab size"),
    (dict(batch=RolloutBatch([[999]], [[1]])), "prompt_ids[0]"),
    (dict(batch=RolloutBatch([[1]], [[1]]), temperature=0.0), "temperature"),
    (dict(batch=RolloutBatch([[1]], [[1]]), temperature=math.nan), "temperature"),
    (dict(batch=RolloutBatch([[1]], [[1]]), temperature=1e-39), "temperature must be finite and >= 1e-05"),
    (dict(batch={"prompt_ids": [[1]]}), "RolloutBatch"),
])
def test_bad_input_raises_value_error(kwargs, needle):
    model = load_model("tiny:qwen3", seed=0)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError) as e:
        compute_logprobs(model, **kwargs)
    assert needle in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_public_names():
    assert polynya.compute_logprobs is compute_logprobs
    with pytest.raises(AttributeError):
        polynya.no_such_name  # noqa: B018

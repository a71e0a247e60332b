"""The batched sampler against a numpy reference of each filter (fixed seeds: deterministic)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.engines.sample.native.sampler import SamplingTensors, sample

V = 12
N = 20000


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """vLLM V1's order: temperature -> min-p (relative to the top probability) -> top-k (ties
    with the k-th logit kept) -> top-p (on what is left, renormalised)."""
    x = logits.astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs >= p.min_p * probs.max()
    order = np.argsort(-x, kind="stable")
    k = len(x) if p.top_k < 0 else p.top_k
    keep &= x >= x[order[k - 1]]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep[order[mass_before >= p.top_p]] = False
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def draws(n: int, seed: int) -> list[float]:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).tolist()


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(V, generator=g) * 1.5


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.8),
    SamplingParams(temperature=1.2, min_p=0.15),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_distribution_matches_reference(logits, params):
    st = SamplingTensors.build([params] * N, draws(N, seed=1000), V, "cpu")
    tokens, logprobs = sample(logits.expand(N, V), st)
    ref = reference_probs(logits.numpy(), params)
    freq = np.bincount(tokens.numpy(), minlength=V) / N
    assert np.all(freq[ref == 0] == 0), "a filtered-out token was sampled"
    sigma = np.sqrt(ref * (1 - ref) / N)
    assert np.all(np.abs(freq - ref) <= 5 * sigma + 1e-9), (freq, ref)
    # the returned log-prob is that of the distribution actually sampled from
    np.testing.assert_allclose(logprobs.numpy(), np.log(ref[tokens.numpy()]), rtol=0, atol=1e-5)


def test_mixed_rows_and_greedy(logits):
    """Rows with different settings in one batch behave as if sampled alone."""
    rows = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=0.3, seed=1)]
    st = SamplingTensors.build(rows, draws(3, seed=0), V, "cpu")
    tokens, lps = sample(torch.stack([logits, logits, logits]), st)
    top = int(logits.argmax())
    assert tokens.tolist()[:2] == [top, top]
    # greedy log-prob is under the unmodified model distribution; top_k=1 is a point mass
    assert lps[0].item() == pytest.approx(torch.log_softmax(logits, -1)[top].item(), abs=1e-6)
    assert lps[1].item() == pytest.approx(0.0, abs=1e-6)
    assert tokens[2].item() in torch.topk(logits, V).indices.tolist()


def test_rows_are_independent_of_batch(logits):
    """A row's token depends on its own uniform draw only, not on its neighbours."""
    p = SamplingParams(temperature=1.0)
    u = draws(3, seed=5)
    alone = sample(logits[None], SamplingTensors.build([p], u[1:2], V, "cpu"))[0]
    batch = sample(logits.expand(3, V), SamplingTensors.build([p] * 3, u, V, "cpu"))[0]
    assert batch[1].item() == alone[0].item()


@pytest.mark.parametrize("vocab,chunk", [(5003, 64), (4096, 1024), (300, 7)])
def test_two_level_inverse_cdf_matches_one_scan(vocab, chunk):
    """The chunked inverse CDF picks the same index as one full scan, on random peaked and flat
    rows (ties at float boundaries aside), and never an index past the vocabulary."""
    from polynya.engines.sample.native.sampler import inverse_cdf

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(256, vocab, generator=g) * torch.tensor([0.3, 3.0]).repeat(128)[:, None]
    logits[::7, vocab // 3:] = float("-inf")  # rows whose tail is filtered out
    probs = logits.softmax(-1)
    u = torch.rand(256, generator=g)
    got = inverse_cdf(probs, u, chunk=chunk)
    cdf = probs.double().cumsum(-1)
    ref = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
    assert got.shape == (256,) and got.dtype == torch.int64
    assert (got < vocab).all() and (probs.gather(1, got[:, None]) > 0).all()
    assert (got == ref).float().mean() >= 0.99, (got != ref).sum()
def test_rows_are_independent_of_neighbours_filters():
    """A row's token and log-prob do not depend on the filters its neighbours use (a top-p
    neighbour once made every row sample in sorted order: seeded requests changed with the
    batch they landed in)."""
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(64, V, generator=g) * 2
    kinds = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
             SamplingParams(temperature=1.3, top_k=4), SamplingParams(min_p=0.2),
             SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, top_k=6, min_p=0.05)]
    params = [kinds[i % len(kinds)] for i in range(len(rows))]
    u = draws(len(rows), seed=9)
    tok, lp = sample(rows, SamplingTensors.build(params, u, V, "cpu"))
    for i, p in enumerate(params):
        t1, lp1 = sample(rows[i:i + 1], SamplingTensors.build([p], u[i:i + 1], V, "cpu"))
        assert (tok[i].item(), lp[i].item()) == (t1.item(), lp1.item()), (i, p)


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 1e-30])
def test_a_top_p_that_is_zero_in_float32_keeps_the_top_token(logits, top_p):
    """``top_p`` below float32's smallest value rounds to 0 on the device: the filter still keeps
    the most likely token (it dropped every token, and the sample came out as token 0 with a NaN
    log-prob)."""
    params = SamplingParams(temperature=1.0, top_p=top_p)
    st = SamplingTensors.build([params] * 4, draws(4, seed=7), V, "cpu")
    tokens, logprobs = sample(logits.expand(4, V), st)
    assert tokens.tolist() == [int(logits.argmax())] * 4
    assert torch.equal(logprobs, torch.zeros(4))  # the one token kept: probability 1

"""The native sampler against vLLM V1's sampling rules, on fresh random logits (CPU).

Oracle: ``vllm_keep`` below, a plain-torch transcription of vLLM V1's filter path
(``vllm/v1/sample/sampler.py`` ``Sampler.sample``: temperature, then the argmax-invariant
logits processors — min-p, ``MinPLogitsProcessor`` — then ``apply_top_k_top_p_pytorch`` of
``ops/topk_topp_sampler.py``: top-k keeps every logit ``>=`` the k-th largest, top-p drops the
ascending cumulative mass ``<= 1 - p`` and always keeps the largest). Greedy rows take
``argmax`` of the raw logits and ignore the filters (``SamplingParams.__post_init__`` resets
them for ``temperature < 1e-5``).
"""
from __future__ import annotations

import pytest
import torch
from polynya import SamplingParams
from polynya.engines.sample.native.sampler import SamplingTensors, filter_logits, sample

from .test_native_engine import make_engine, ragged_prompts


def vllm_keep(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``[B, V]`` bool: the tokens vLLM V1 may sample (float64, row by row)."""
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    for i, p in enumerate(params):
        x = logits[i].double() / p.temperature
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        xs, idx = x.sort(descending=False)
        v = len(xs)
        if 0 < p.top_k < v:
            xs = xs.masked_fill(xs < xs[v - p.top_k], float("-inf"))
        if p.top_p < 1.0:
            mask = xs.softmax(-1).cumsum(-1) <= 1 - p.top_p
            mask[-1] = False
            xs = xs.masked_fill(mask, float("-inf"))
        keep[i, idx] = xs > float("-inf")
    return keep


def kept(logits: torch.Tensor, params: list[SamplingParams], device: str = "cpu") -> torch.Tensor:
    st = SamplingTensors.build(params, [0.5] * len(params), logits.shape[-1], device)
    return (filter_logits(logits.float().to(device), st) > float("-inf")).cpu()


def test_min_p_applies_before_top_p():
    """probs [.5, .3, .1, .1], min_p .3 (removes both .1), top_p .6: vLLM renormalises to
    [.625, .375] before top-p and keeps token 0 alone; top-p first kept tokens 0 and 1."""
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
    p = [SamplingParams(top_p=0.6, min_p=0.3)]
    assert vllm_keep(logits, p).tolist() == [[True, False, False, False]]
    assert kept(logits, p).tolist() == [[True, False, False, False]]
    tok, lp = sample(logits, SamplingTensors.build(p, [0.99], 4, "cpu"))
    assert (tok.item(), lp.item()) == (0, 0.0)


def test_top_k_keeps_every_token_tied_with_the_kth():
    """bf16 logits tie often: vLLM keeps all tokens equal to the k-th largest logit."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 2.0]])
    p = [SamplingParams(top_k=2)]
    assert vllm_keep(logits, p).tolist() == [[True, True, True, True, False, True]]
    assert kept(logits, p).tolist() == vllm_keep(logits, p).tolist()


def random_params(g: torch.Generator, n: int, vocab: int) -> list[SamplingParams]:
    def pick(choices):
        return choices[int(torch.randint(len(choices), (), generator=g))]
    return [SamplingParams(temperature=pick([0.3, 0.7, 1.0, 1.6]),
                           top_k=pick([-1, 1, 2, 5, vocab - 1, vocab, vocab + 7]),
                           top_p=pick([1.0, 0.95, 0.8, 0.5, 0.1]),
                           min_p=pick([0.0, 0.0, 0.02, 0.1, 0.4])) for _ in range(n)]


@pytest.mark.parametrize("vocab", [7, 50, 301])
def test_filters_match_vllm_on_random_logits(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 400
    logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g).mul(4).add(0.2)
    params = random_params(g, rows, vocab)
    ref, got = vllm_keep(logits, params), kept(logits, params)
    bad = (ref != got).any(-1).nonzero()[:, 0].tolist()
    assert not bad, [(i, params[i]) for i in bad[:5]]


def tied_bf16_case(vocab: int, rows: int = 300):
    """Logits rounded to bf16 (ties at the top-k boundary) with top-k and min-p settings whose
    thresholds fall between the bf16 grid's differences: the kept set is exact in float32."""
    g = torch.Generator().manual_seed(vocab + 1)
    logits = (torch.randn(rows, vocab, generator=g) * 3).bfloat16().float()
    params = [SamplingParams(temperature=t, top_k=k, min_p=m)
              for t, k, m in zip([0.5, 1.0, 1.3] * 100, [1, 3, 10, 40, vocab + 1] * 60,
                                 [0.0, 0.05, 0.3] * 100)][:rows]
    return logits, params


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["random, top-p", "tied bf16, Qwen's vocabulary"])
def test_filters_match_vllm_on_the_gpu(case):
    """The filters on CUDA: the kept sets equal vLLM's rules and the CPU's, and every sample is
    a token vLLM may draw. (Top-p is checked on a small vocabulary only: on 151936 tokens the
    probabilities around its boundary are within float32 rounding of each other.)"""
    if case.startswith("random"):
        g = torch.Generator().manual_seed(304)
        logits = torch.randn(400, 301, generator=g) * torch.rand(400, 1, generator=g).mul(4).add(0.2)
        params = random_params(g, 400, 301)
    else:
        logits, params = tied_bf16_case(151936, rows=60)
    ref, got = vllm_keep(logits, params), kept(logits, params, "cuda")
    bad = (ref != got).any(-1).nonzero()[:, 0].tolist()
    assert not bad, [(i, params[i]) for i in bad[:5]]
    assert torch.equal(got, kept(logits, params))
    rows = len(params)
    tok, lp = sample(logits.cuda(), SamplingTensors.build(params, [0.3] * rows, logits.shape[1], "cuda"))
    assert ref[torch.arange(rows), tok.cpu()].all()
    assert torch.isfinite(lp).all() and (lp <= 0).all()


@pytest.mark.parametrize("vocab", [64, 1000])
def test_top_k_and_min_p_match_vllm_on_tied_bf16_logits(vocab):
    """Logits rounded to bf16 (ties at the top-k boundary); top-p is left out: which of a tied
    group crosses ``top_p`` depends on the sort's order in vLLM too."""
    logits, params = tied_bf16_case(vocab)
    assert torch.equal(kept(logits, params), vllm_keep(logits, params))


def test_sampled_tokens_follow_vllm_distribution():
    """Sampling frequencies and returned log-probs (processed: of the filtered, renormalised
    distribution) on one row where the old order (top-p before min-p) differs."""
    logits = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).log()
    p = SamplingParams(temperature=1.0, top_p=0.55, min_p=0.25)  # vLLM: {0}; top-p first: {0, 1}
    keep = vllm_keep(logits[None], [p])[0]
    ref = torch.where(keep, logits.double().softmax(-1), 0.0)
    ref /= ref.sum()
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64).tolist()
    tok, lp = sample(logits.expand(n, -1), SamplingTensors.build([p] * n, u, 5, "cpu"))
    freq = torch.bincount(tok, minlength=5).double() / n
    assert torch.all(freq[~keep] == 0)
    assert torch.all((freq - ref).abs() <= 5 * (ref * (1 - ref) / n).sqrt() + 1e-9), (freq, ref)
    torch.testing.assert_close(lp.double(), ref[tok].log(), rtol=0, atol=1e-5)


def test_greedy_takes_first_argmax_and_ignores_filters():
    """temperature 0: the first maximal index (torch/vLLM argmax), whatever top-k / top-p /
    min-p say, and the log-prob of the raw model distribution."""
    logits = torch.tensor([[0.0, 2.0, 5.0, 5.0, 1.0]] * 4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, top_k=1, top_p=0.1, min_p=0.9),
              SamplingParams(temperature=0, top_k=3), SamplingParams(temperature=1.0, top_k=1)]
    tok, lp = sample(logits, SamplingTensors.build(params, [0.0, 0.0, 0.0, 0.999], 5, "cpu"))
    raw = logits[0].log_softmax(-1)[2].item()
    assert tok.tolist()[:3] == [2, 2, 2]
    assert lp.tolist()[:3] == pytest.approx([raw] * 3, abs=1e-6)
    assert tok[3].item() in (2, 3)  # top_k=1 with a tie at the top keeps both, as vLLM


@pytest.fixture(scope="module")
def qwen():
    return make_engine()


def test_seed_gives_the_same_tokens_alone_and_batched(qwen):
    """A seeded request: the same completions alone as next to other prompts; its n samples
    differ from each other (vLLM: different samples per n under one seed)."""
    prompts = ragged_prompts(21, [7, 5, 9])
    p = SamplingParams(n=4, temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, max_tokens=8,
                       seed=77, stop_token_ids=(), logprobs=True)
    alone = qwen.generate([prompts[1]], p)[0]
    batched = qwen.generate(prompts, p)[1]
    assert [s.token_ids for s in alone] == [s.token_ids for s in batched]
    for a, b in zip(alone, batched):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert len({tuple(s.token_ids) for s in alone}) > 1


def test_stop_token_is_in_the_output_with_its_logprob(qwen):
    """vLLM keeps the stop / EOS token in ``token_ids`` and gives it a log-prob; ``max_tokens``
    counts it; a stop on the last allowed token is a stop, not a length (vLLM's check_stop
    tests the stop ids before the length)."""
    prompt = ragged_prompts(5, [6])[0]
    free = qwen.generate([prompt], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(),
                                                  logprobs=True))[0][0]
    stop = free.token_ids[2]
    assert stop not in free.token_ids[:2]
    out = qwen.generate([prompt], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop],
                                                 logprobs=True))[0][0]
    assert out.token_ids == free.token_ids[:3] and out.finish_reason == "stop"
    assert out.logprobs == pytest.approx(free.logprobs[:3], abs=1e-6)
    last = qwen.generate([prompt], SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[stop]))[0][0]
    assert (last.token_ids, last.finish_reason) == (free.token_ids[:3], "stop")
    short = qwen.generate([prompt], SamplingParams(temperature=0, max_tokens=2, stop_token_ids=[stop]))[0][0]
    assert (short.token_ids, short.finish_reason) == (free.token_ids[:2], "length")

"""``SamplingParams.min_tokens`` as vLLM applies it: the row's stop ids (EOS and
``stop_token_ids``, as the stop rule says) are removed from its logits until the completion has
``min_tokens`` tokens — greedy and sampled rows, forks, preempted rows recomputed, steps
launched ahead — and the returned log-probs are of the distribution without them
(tiny random qwen3, fp32, CPU; the CUDA-graph path in ``test_native_engine_gpu.py``).

(Before: ``min_tokens`` up to 1 was accepted on the vLLM routes and not applied — SkyRL's
generator always sends 1 — so a completion could end at its first token where vLLM masks it.)
"""
from __future__ import annotations

import pytest
import torch
from polynya import SamplingParams
from polynya.client.ecosystem import generate_params
from polynya.client.openai_compat import _COMPLETION_KEYS, sampling_params
from polynya.models import load_model

from .test_native_engine import make_engine, ragged_prompts
from .vllm_reference import masked_greedy


@pytest.fixture(scope="module")
def case():
    """An engine whose EOS is the 2nd token of a free greedy run (so it would stop at once)."""
    engine = make_engine()
    hf = load_model("tiny:qwen3", dtype="float32")
    prompt = ragged_prompts(11, [6])[0]
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=()))[0][0]
    eos = free.token_ids[1]
    assert eos != free.token_ids[0]
    engine.backend.default_stop_ids = frozenset({eos})
    return engine, hf, prompt, eos


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 5, 12])
def test_greedy_rows_follow_vllms_rule(case, min_tokens):
    engine, hf, prompt, eos = case
    got = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=min_tokens,
                                                   logprobs=True))[0][0]
    want, want_lp = masked_greedy(hf, prompt, 12, {eos}, min_tokens)
    assert got.token_ids == want
    assert got.logprobs == pytest.approx(want_lp, abs=1e-5)
    assert eos not in got.token_ids[:min_tokens]
    if min_tokens < 2:
        assert got.token_ids == [want[0], eos] and got.finish_reason == "stop"
    assert engine.stats()["blocks_in_use"] == 0


def test_every_stop_id_of_the_row_is_held_back(case):
    """Sampled rows (n forks of one prompt, other requests beside them, one without
    min_tokens): no stop id in the first min_tokens tokens of any fork; the row without it still
    stops early; the cache is small enough that rows are preempted and recomputed."""
    engine, hf, prompt, eos = case
    small = make_engine(num_blocks=20, max_num_seqs=16)
    small.backend.default_stop_ids = frozenset({eos})
    other = ragged_prompts(12, [9])[0]
    stops = [eos, 3, 17]
    params = [SamplingParams(n=10, temperature=1.5, max_tokens=8, min_tokens=6, seed=1,
                             stop_token_ids=stops[1:], stop_at_eos=True, logprobs=True),
              SamplingParams(n=6, temperature=1.5, max_tokens=8, seed=2, stop_token_ids=stops)]
    out = small.generate([prompt, other], params)
    assert small.stats()["preemptions"] > 0
    for s in out[0]:
        assert not set(s.token_ids[:6]) & set(stops), s.token_ids
        assert len(s.token_ids) >= 6 and all(lp <= 0 for lp in s.logprobs)
    assert min(len(s.token_ids) for s in out[1]) < 6  # without min_tokens a row may stop early
    assert small.stats()["blocks_in_use"] == 0


def test_logprobs_are_of_the_distribution_without_the_stop_ids(case):
    engine, hf, prompt, eos = case
    got = engine.generate([prompt], SamplingParams(temperature=0.8, max_tokens=4, min_tokens=3,
                                                   seed=4, logprobs=True, stop_token_ids=[eos]))[0][0]
    ids = torch.tensor([prompt + got.token_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float() / 0.8
    logits[:3, eos] = float("-inf")
    want = logits.log_softmax(-1).gather(-1, torch.tensor(got.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got.logprobs), want, rtol=0, atol=1e-5)


def test_stop_ids_outside_the_vocabulary_are_held_back_as_no_op(case):
    """A stop id past the logits (a tokenizer's added id, a typo) can never be sampled: with
    ``min_tokens`` the in-vocabulary stop ids are still banned and the rest is a no-op. (Before:
    the ban indexed past the logits — IndexError on the CPU, a device-side assert on a GPU —
    so the request failed with a 500 and, on a GPU, the engine with it.)"""
    engine, hf, prompt, eos = case
    vocab = engine.backend.runner.vocab_size
    want, want_lp = masked_greedy(hf, prompt, 12, {eos}, 5)
    got = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=5,
                                                   stop_token_ids=[vocab, 1 << 40], stop_at_eos=True,
                                                   logprobs=True))[0][0]
    assert got.token_ids == want and got.logprobs == pytest.approx(want_lp, abs=1e-5)
    assert engine.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("bad", [-1, 13, 1.5, True, "2"])
def test_a_bad_min_tokens_is_refused(bad):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=12, min_tokens=bad)


@pytest.mark.parametrize("translate", [
    generate_params,
    lambda body: sampling_params(body, _COMPLETION_KEYS),
], ids=["inference_generate", "openai_completions"])
def test_vllm_routes_pass_min_tokens_on(translate):
    assert translate({"min_tokens": 4, "max_tokens": 9}).min_tokens == 4
    assert translate({"max_tokens": 9}).min_tokens == 0
    with pytest.raises(ValueError, match="min_tokens"):
        translate({"min_tokens": 10, "max_tokens": 9})


@pytest.mark.gpu
def test_min_tokens_on_the_gpu_with_steps_launched_ahead(case):
    """CUDA engine (CUDA graphs, async scheduling: each decode step launched before the
    previous one is booked, so its ban counts that token): greedy equal to vLLM's rule on the
    HF model, and sampled forks free of stop ids until ``min_tokens``."""
    _, hf, prompt, eos = case
    engine = make_engine(device="cuda", num_blocks=512)
    engine.backend.default_stop_ids = frozenset({eos})
    for min_tokens in (0, 3, 12):
        got = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                       min_tokens=min_tokens))[0][0]
        assert got.token_ids == masked_greedy(hf, prompt, 12, {eos}, min_tokens)[0]
    out = engine.generate([prompt], SamplingParams(n=32, temperature=1.5, max_tokens=10,
                                                   min_tokens=7, seed=3, stop_token_ids=[eos, 3, 17]))[0]
    assert all(not set(s.token_ids[:7]) & {eos, 3, 17} and len(s.token_ids) >= 7 for s in out)
    stats = engine.stats()
    assert stats["blocks_in_use"] == 0
    assert stats["ahead_steps"] > 0 and stats["early_steps"] > 0  # the ahead path ran

"""``SamplingEngine.prompt_logprobs`` (scoring given sequences on the native sampler) against a
plain HF forward and ``polynya.compute_logprobs`` of the same tokens (fp32, CPU), on ragged
random sequences packed over several forwards; the KV cache is left untouched."""
from __future__ import annotations

import numpy as np
import polynya
import pytest
import torch
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.engines.sample import scoring
from polynya.models import TINY_SLIDING_WINDOW, load_model

LENGTHS = [1, 2, 7, 13, 3, 2 * TINY_SLIDING_WINDOW + 5]  # one past the sliding window (gemma2)


def _seqs(seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(0, 512, size=n).tolist() for n in LENGTHS]


def _hf_reference(model, seq: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].float()
    return torch.log_softmax(logits / temperature, dim=-1)  # [L-1, V]


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_scores_equal_hf_forward_and_compute_logprobs(family, monkeypatch):
    monkeypatch.setattr(scoring, "LOGITS_CHUNK_BYTES", 16 * 4 * 512)  # head chunks of 16 positions
    spec = f"tiny:{family}"
    engine = SamplingEngine(SamplerConfig(spec, dtype="float32", device="cpu", block_size=4,
                                          num_blocks=64, max_num_batched_tokens=24, seed=0))
    model = load_model(spec, dtype=torch.float32, seed=0)  # the sampler's weights (same spec, seed)
    seqs, temperature, k = _seqs(1), 0.7, 5
    before = engine.stats()
    out = engine.prompt_logprobs(seqs, top_k=k, temperature=temperature)
    after = engine.stats()

    batch = polynya.RolloutBatch([s[:1] for s in seqs], [s[1:] for s in seqs])
    with torch.no_grad():
        ours = polynya.compute_logprobs(model, batch, zorro=False, temperature=temperature)
    assert len(out) == len(seqs)
    for i, (seq, got) in enumerate(zip(seqs, out)):
        n = len(seq) - 1
        assert got.logprobs.shape == (n,) and got.top_ids.shape == (n, k) and got.ranks.dtype == torch.int64
        ref = _hf_reference(model, seq, temperature)
        target = torch.tensor(seq[1:], dtype=torch.long)
        want = ref.gather(1, target[:, None])[:, 0]
        torch.testing.assert_close(got.logprobs, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.logprobs, ours.logprobs[i, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(got.ranks, (ref > want[:, None]).sum(-1) + 1)
        top_v, top_i = ref.topk(k, dim=-1)
        torch.testing.assert_close(got.top_logprobs, top_v, atol=1e-5, rtol=0)
        assert torch.equal(got.top_ids, top_i)
    assert after["scored_tokens"] - before["scored_tokens"] == sum(LENGTHS)
    for key in ("prefill_tokens", "blocks_in_use", "cache_hit_tokens", "decode_tokens"):
        assert after[key] == before[key], key  # no pages read, written or kept


def test_whole_vocabulary_zero_temperature_and_generation_after():
    engine = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu", block_size=4,
                                          num_blocks=64, seed=0))
    model = load_model("tiny:qwen3", dtype=torch.float32, seed=0)
    seq = _seqs(2)[3]
    full = engine.prompt_logprobs([seq], top_k=-1, temperature=0)[0]  # 0 reads as 1 (greedy's log-probs)
    ref = _hf_reference(model, seq, 1.0)
    assert full.top_ids.shape == (len(seq) - 1, ref.shape[1])
    torch.testing.assert_close(full.top_logprobs.exp().sum(-1), torch.ones(len(seq) - 1))
    torch.testing.assert_close(full.top_logprobs, ref.topk(ref.shape[1], dim=-1).values, atol=1e-5, rtol=0)
    only = engine.prompt_logprobs([seq], top_k=0)[0]  # k = 0: the sequence's own tokens only
    assert only.top_ids.shape == (len(seq) - 1, 0)
    torch.testing.assert_close(only.logprobs, full.logprobs)
    # generation afterwards is unaffected: greedy equals HF's greedy
    got = engine.generate([seq], polynya.SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[]))
    want = model.generate(torch.tensor([seq]), max_new_tokens=4, do_sample=False,
                          attention_mask=torch.ones(1, len(seq), dtype=torch.long))[0, len(seq):].tolist()
    assert got[0][0].token_ids == want


def test_bad_requests_are_refused_and_change_nothing():
    engine = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu", block_size=4,
                                          num_blocks=8, seed=0))
    before = engine.stats()
    for bad, msg in [({"sequences": [[1, 2], [3, 512]]}, "outside"), ({"sequences": [[]]}, "empty"),
                     ({"sequences": [[1, 2]], "top_k": -2}, "prompt_logprobs"),
                     ({"sequences": [[1, 2]], "top_k": True}, "prompt_logprobs"),
                     ({"sequences": [[1, 2]], "temperature": -1.0}, "temperature"),
                     ({"sequences": [list(range(33))]}, "window")]:
        kw = {"top_k": 1, **bad}
        with pytest.raises(ValueError, match=msg):
            engine.prompt_logprobs(kw.pop("sequences"), **kw)
    assert engine.stats() == before
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.prompt_logprobs([[1, 2, 3]], top_k=1)
    engine.wake()
    assert engine.prompt_logprobs([[1, 2, 3]], top_k=1)[0].logprobs.shape == (2,)


@pytest.mark.gpu
def test_scores_on_cuda_equal_compute_logprobs():
    """Random Qwen3-0.6B shape, fp32 on CUDA (flash-free SDPA, the head in chunks of a 151k
    vocabulary): scores equal ``compute_logprobs`` of the same weights on the same GPU."""
    spec = "random:qwen3-0.6b"
    engine = SamplingEngine(SamplerConfig(spec, dtype="float32", device="cuda", kv_cache_memory_gb=1, seed=0,
                                          max_num_batched_tokens=700))
    model = load_model(spec, dtype=torch.float32, device="cuda", seed=0)
    g = np.random.default_rng(5)
    seqs = [g.integers(100, 150000, size=n).tolist() for n in (37, 300, 129, 513)]
    out = engine.prompt_logprobs(seqs, top_k=8, temperature=0.9)
    batch = polynya.RolloutBatch([s[:1] for s in seqs], [s[1:] for s in seqs])
    with torch.no_grad():
        ref = polynya.compute_logprobs(model, batch, zorro=False, temperature=0.9).logprobs.cpu()
        for i, (seq, got) in enumerate(zip(seqs, out)):
            torch.testing.assert_close(got.logprobs, ref[i, :len(seq) - 1], atol=2e-4, rtol=0)
            logits = model(torch.tensor([seq], device="cuda")).logits[0, :-1].float()
            top = torch.log_softmax(logits / 0.9, dim=-1).topk(8, dim=-1).values.cpu()
            torch.testing.assert_close(got.top_logprobs, top, atol=2e-4, rtol=0)

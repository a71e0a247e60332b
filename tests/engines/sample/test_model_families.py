"""The model-family matrix for the native sampler on CPU: greedy tokens equal HF ``generate``
(transformers' eager attention, its own caches) for prompts longer than the sliding window,
with forks, a shared system prompt served from the prefix cache, and FCA on (full-attention
layers) — or a clear refusal at load time.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.models import TINY_SLIDING_WINDOW, load_model

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3-moe", "mistral", "gemma2", "gemma3", "phi3",
            "olmo2", "qwen2-window"]
REFUSED = {"gpt-oss": "the native sampler does not implement attention sinks, which tiny:gpt-oss "
                      "(gpt_oss) uses; use SamplerConfig(backend='vllm') for this model"}
NEW = 12


def prompts(seed: int) -> list[list[int]]:
    """Two prompts behind one system prompt longer than the window (the second prefill reads
    it from the prefix cache), one short prompt, one long one without the system prompt."""
    g = np.random.default_rng(seed)
    system = g.integers(4, 512, size=2 * TINY_SLIDING_WINDOW + 1).tolist()
    return [system + g.integers(4, 512, size=5).tolist(), system + g.integers(4, 512, size=3).tolist(),
            g.integers(4, 512, size=3).tolist(), g.integers(4, 512, size=3 * TINY_SLIDING_WINDOW).tolist()]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         do_sample=False, eos_token_id=None, pad_token_id=1)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_native_greedy_equals_hf_generate(family):
    spec = f"tiny:{family}"
    engine = SamplingEngine(SamplerConfig(spec, dtype="float32", device="cpu", block_size=4,
                                          num_blocks=128, fca=True))
    hf = load_model(spec, seed=0, attn_implementation="eager")
    ps = prompts(len(family))
    # the first prompt alone first, so the second's system prompt comes from the prefix cache
    first = engine.generate(ps[:1], SamplingParams(n=2, temperature=0, max_tokens=NEW, stop_token_ids=()))
    rest = engine.generate(ps[1:], SamplingParams(n=2, temperature=0, max_tokens=NEW, stop_token_ids=()))
    assert engine.stats()["cache_hit_tokens"] >= 4 * (2 * TINY_SLIDING_WINDOW // 4)
    for prompt, samples in zip(ps, first + rest):
        ref = hf_greedy(hf, prompt)
        assert [s.token_ids for s in samples] == [ref, ref], family


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_fca_off_gives_the_same_tokens(family):
    spec = f"tiny:{family}"
    ps = prompts(7)
    outs = []
    for fca in (True, False):
        engine = SamplingEngine(SamplerConfig(spec, dtype="float32", device="cpu", block_size=4,
                                              num_blocks=128, fca=fca))
        outs.append([[s.token_ids for s in o] for o in engine.generate(
            ps, SamplingParams(n=3, temperature=0, max_tokens=NEW, stop_token_ids=()))])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_family_is_refused_at_load(family):
    with pytest.raises(ValueError) as err:
        SamplingEngine(SamplerConfig(f"tiny:{family}", dtype="float32", device="cpu"))
    assert str(err.value) == REFUSED[family]

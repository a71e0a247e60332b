"""The native sampler's model-family matrix on the GPU (written to spec; run with ``-m gpu``).

fp32: greedy tokens equal HF ``generate`` (eager attention) for prompts far longer than the tiny
window (8 tokens, inside one 16-token page),
with FCA + CUDA graphs and without — windowed layers decode through the Triton paged kernel
with its ``window``, soft-capped ones through the kernels' ``softcap``. bf16 (rounding may
flip near-ties, so token equality is the wrong test): every token the bf16 engine picks
greedily is a near-argmax of the fp32 model teacher-forced on the same tokens — its fp32 logit
is within twice transformers' own bf16 logit error of the best one.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.models import TINY_SLIDING_WINDOW, load_model

from .test_model_families import FAMILIES, REFUSED

pytestmark = pytest.mark.gpu
WINDOWED = {"mistral", "gemma2", "gemma3", "phi3", "qwen2-window"}
NEW = 24


def prompts() -> list[list[int]]:
    g = np.random.default_rng(0)
    system = g.integers(4, 512, size=80).tolist()  # >> the window, shared (FCA + prefix cache)
    return [system + g.integers(4, 512, size=n).tolist() for n in (5, 37, 70)] + \
        [g.integers(4, 512, size=130).tolist()]


def hf_greedy(family, dtype) -> list[list[int]]:
    model = load_model(f"tiny:{family}", dtype=dtype, device="cuda", attn_implementation="eager")
    out = []
    for p in prompts():
        ids = torch.tensor([p], device="cuda")
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, pad_token_id=1)
        out.append(gen[0, len(p):].tolist())
    return out


def engine_greedy(family, dtype, fca, graphs) -> list[list[list[int]]]:
    cfg = SamplerConfig(f"tiny:{family}", dtype=dtype, device="cuda", fca=fca, cuda_graphs=graphs,
                        block_size=16, num_blocks=512, max_num_seqs=32)
    engine = SamplingEngine(cfg)
    windows = engine.backend.runner.features.layer_windows
    assert (TINY_SLIDING_WINDOW in windows) == (family in WINDOWED)
    out = engine.generate(prompts(), SamplingParams(n=3, temperature=0, max_tokens=NEW,
                                                    stop_token_ids=()))
    return [[s.token_ids for s in o] for o in out]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_equals_hf_generate(family):
    ref = hf_greedy(family, "float32")
    for fca, graphs in ((True, True), (False, True), (True, False)):
        got = engine_greedy(family, "float32", fca, graphs)
        for r, samples in zip(ref, got):
            assert all(s == r for s in samples), (family, fca, graphs)
        torch.cuda.empty_cache()


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_greedy_picks_fp32_near_argmax(family):
    got = [o[0] for o in engine_greedy(family, "bfloat16", True, True)]
    f32, b16 = (load_model(f"tiny:{family}", dtype=d, device="cuda", attn_implementation="eager")
                for d in ("float32", "bfloat16"))
    for prompt, toks in zip(prompts(), got):
        ids = torch.tensor([prompt + toks], device="cuda")
        with torch.no_grad():
            ref = f32(ids).logits[0, len(prompt) - 1:-1].float()
            low = b16(ids).logits[0, len(prompt) - 1:-1].float()
        budget = (low - ref).abs().max().item()
        chosen = ref.gather(1, torch.tensor(toks, device="cuda")[:, None])[:, 0]
        gap = (ref.max(1).values - chosen).max().item()
        assert gap <= 2 * budget + 1e-3, (family, gap, budget)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refusal_on_cuda(family):
    with pytest.raises(ValueError) as err:
        SamplingEngine(SamplerConfig(f"tiny:{family}", dtype="bfloat16", device="cuda"))
    assert str(err.value) == REFUSED[family]

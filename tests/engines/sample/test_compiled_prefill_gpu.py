"""The compiled prefill (``SamplerConfig.compile_prefill``) on CUDA (Inductor's Triton kernels):
fp32 greedy tokens and log-probs equal to the eager prefill's over generates with ragged
prompts, cached prefixes and new lengths every call (q/k-norm and windowed families); in bf16,
where prefill and scoring take the varlen FlashAttention path, prompt log-probs within twice the
eager bf16 prefill's own error against fp32 (plus 0.01), and one compile per region for every
length; after a level-2 sleep (weights off the GPU and back) the numbers stay the eager ones."""
from __future__ import annotations

import pytest
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine

from .test_compiled_prefill import assert_same_samples, calls, run

pytestmark = pytest.mark.gpu


def cuda_engine(family: str, dtype: str, compile_prefill: bool) -> SamplingEngine:
    return SamplingEngine(SamplerConfig(f"tiny:{family}", dtype=dtype, device="cuda", block_size=16,
                                        num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                                        compile_decode=False, compile_prefill=compile_prefill))


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_fp32_compiled_prefill_equals_eager_on_cuda(family):
    compiled, eager = cuda_engine(family, "float32", True), cuda_engine(family, "float32", False)
    assert_same_samples(run(compiled), run(eager))
    stats = compiled.stats()
    assert stats["prefill_compile_reason"] is None and stats["prefill_compiles"] == 2
    assert stats["cache_hit_tokens"] > 0
    compiled.sleep(level=2)  # the weights leave the GPU and come back (new storages)
    compiled.wake()
    assert_same_samples(run(compiled, seed=5), run(eager, seed=5))
    assert compiled.stats()["prefill_compiles"] == 2


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_bf16_prompt_logprobs_within_the_eager_error(family):
    ref = cuda_engine(family, "float32", False)
    eager, compiled = cuda_engine(family, "bfloat16", False), cuda_engine(family, "bfloat16", True)
    seqs = calls(7)[0][0] + calls(8)[2][0]
    for batch in (seqs, [s[: len(s) // 2 + 3] for s in seqs]):  # new lengths: no recompile
        want = ref.prompt_logprobs(batch, top_k=1, temperature=1.0)
        same = eager.prompt_logprobs(batch, top_k=1, temperature=1.0)
        got = compiled.prompt_logprobs(batch, top_k=1, temperature=1.0)
        for g, s, w in zip(got, same, want, strict=True):
            err = (g.logprobs - w.logprobs).abs().max().item()
            own = (s.logprobs - w.logprobs).abs().max().item()
            assert err <= 2 * own + 1e-2, (err, own)
    assert compiled.stats()["prefill_compiles"] == 2
    # a generate's prefill (cache writes, a cached prefix read back) runs the same regions
    got, same = run(compiled), run(eager)
    firsts = [(a.token_ids[0], b.token_ids[0]) for cg, ce in zip(got, same)
              for rg, re in zip(cg, ce) for a, b in zip(rg, re)]
    assert sum(a == b for a, b in firsts) >= len(firsts) - 1, firsts  # bf16 near-ties aside
    assert compiled.stats()["prefill_compiles"] == 2

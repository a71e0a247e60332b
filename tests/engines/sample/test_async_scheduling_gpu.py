"""Async scheduling on a GPU (skipped without CUDA): the same samples as the synchronous engine,
bit for bit, on a random Qwen3-0.6B-shaped model in bf16 — CUDA graphs and FCA on, 64 rows.

Two engines built alike (same weights from the same seed): one with ``async_scheduling=False``
(the oracle), one with it on. Rows stop on stop tokens at different steps (a wide stop set),
reach ragged ``max_tokens``, fork (n > 1), mix seeded / unseeded / greedy / top-p rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine

from .test_async_scheduling import outputs, same_counters

pytestmark = pytest.mark.gpu
MODEL = "random:qwen3-0.6b"


def engines(**kw) -> tuple[SamplingEngine, SamplingEngine]:
    kw = {"dtype": "bfloat16", "device": "cuda", "kv_cache_memory_gb": 2, "max_num_seqs": 64,
          "fca_min_shared_tokens": 0, "max_model_len": 1024, **kw}
    return (SamplingEngine(SamplerConfig(MODEL, async_scheduling=False, **kw)),
            SamplingEngine(SamplerConfig(MODEL, async_scheduling=True, **kw)))


def workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    g = np.random.default_rng(seed)
    prompts = [g.integers(100, 150000, size=int(n)).tolist() for n in g.integers(20, 300, size=8)]
    stops = tuple(range(1000, 4000))  # ~2 % a step under a random model: rows stop at their own steps
    params = []
    for i in range(8):
        params.append(SamplingParams(
            n=8, temperature=0.0 if i == 7 else 1.0, top_p=0.9 if i % 3 == 1 else 1.0,
            max_tokens=int(g.integers(24, 64)), seed=None if i == 5 else 100 + i,
            stop_token_ids=stops if i % 2 == 0 else (), logprobs=True))
    return prompts, params


@pytest.mark.parametrize("graphs", [True, False])
def test_async_equals_sync_bf16_64_rows(graphs):
    sync, asyn = engines(cuda_graphs=graphs)
    prompts, params = workload(0)
    for _ in range(2):  # the second call runs on a warm prefix cache and captured graphs
        want, got = sync.generate(prompts, params), asyn.generate(prompts, params)
        assert outputs(got) == outputs(want)
    reasons = {s.finish_reason for samples in got for s in samples}
    assert reasons == {"stop", "length"}, reasons
    same_counters(sync.backend, asyn.backend)
    stats = asyn.stats()
    assert stats["ahead_steps"] >= stats["decode_steps"] // 2, stats
    # steps launched before the tokens were back, with stopped rows' extra tokens dropped
    assert stats["early_steps"] > 0 and stats["ahead_rows_dropped"] > 0, stats


def test_async_equals_sync_with_sequences_waiting_on_gpu():
    """64 rows through a batch of 24: sequences wait and join as rows stop."""
    sync, asyn = engines(max_num_seqs=24)
    prompts, params = workload(2)
    want, got = sync.generate(prompts, params), asyn.generate(prompts, params)
    assert outputs(got) == outputs(want)
    same_counters(sync.backend, asyn.backend)
    assert asyn.stats()["prefill_steps"] > 2


def test_async_equals_sync_under_preemption_on_gpu():
    # 40 pages of 16 tokens: the window is what the cache holds (a max_model_len of 1024 is refused)
    sync, asyn = engines(num_blocks=40, kv_cache_memory_gb=None, max_num_seqs=32, max_model_len=None)
    prompts, params = workload(1)
    want, got = sync.generate(prompts[:4], params[:4]), asyn.generate(prompts[:4], params[:4])
    assert outputs(got) == outputs(want)
    assert sync.stats()["preemptions"] > 0
    same_counters(sync.backend, asyn.backend)
    torch.cuda.synchronize()

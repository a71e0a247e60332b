"""FCA profiles on a GPU (skipped without CUDA): ``SamplerConfig.fca_chunk_tokens`` (the plan's
split-K items) and ``fca_shared_progs_per_sm`` (the shared pass's launch) change how FCA's work
is cut and scheduled, never the numbers beyond rounding.

Random Qwen3-0.6B shape, fp32, CUDA graphs: an engine that cuts shared prefixes into one-page
items and runs three shared programs per SM against one with the kernel's defaults (2048, 1) — every teacher-forced
step's logits, eager and compiled (FCA path, and paged as a control), within 1e-4; greedy
tokens equal over forks behind a 160-token system prompt (ten one-page items per group against
one), every decode step of it through FCA; its plans hold more shared items than the other's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.kernels.fca import plan_forest

from .test_compiled_decode import teacher_forced

pytestmark = pytest.mark.gpu
MODEL = "random:qwen3-0.6b"


def engine(**kw) -> SamplingEngine:
    return SamplingEngine(SamplerConfig(MODEL, dtype="float32", device="cuda", kv_cache_memory_gb=2,
                                        max_num_seqs=32, fca_min_shared_tokens=0,
                                        compile_decode=True, **kw))


def greedy(e: SamplingEngine) -> list[list[int]]:
    g = np.random.default_rng(3)
    system = g.integers(100, 150000, size=160).tolist()
    prompts = [system + g.integers(100, 150000, size=int(n)).tolist() for n in (9, 40, 23)]
    out = e.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=16, stop_token_ids=()))
    return [s.token_ids for o in out for s in o]


def test_fca_profile_changes_the_work_not_the_numbers():
    base = engine(fca_chunk_tokens=2048, fca_shared_progs_per_sm=1)
    cut = engine(fca_chunk_tokens=16, fca_shared_progs_per_sm=3)
    want, got = greedy(base), greedy(cut)
    assert got == want
    stats = cut.stats()
    assert stats["fca_steps"] == stats["decode_steps"] > 0
    for fca in (True, False):
        for forward in ("_decode_eager", "compiled"):
            ref = teacher_forced(base.backend.runner, getattr(base.backend.runner, forward), fca)
            out = teacher_forced(cut.backend.runner, getattr(cut.backend.runner, forward), fca)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # the plans the two runners build for the same step differ in their items
    tables = torch.arange(1, 13, dtype=torch.int32, device="cuda").repeat(4, 1)
    tables[:, -1] += torch.arange(4, dtype=torch.int32, device="cuda") * 100
    lens = torch.full((4,), 12 * 16, dtype=torch.int32, device="cuda")
    items = {r.config.fca_chunk_tokens: int(plan_forest(
        tables, lens, 16, chunk_tokens=r.config.fca_chunk_tokens).n_shared.item())
        for r in (base.backend.runner, cut.backend.runner)}
    assert items == {2048: 1, 16: 11}, items

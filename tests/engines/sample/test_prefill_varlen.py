"""The prefill's varlen segments (``attention.PrefillVarlen``, one FlashAttention-2 call per
layer on CUDA) describe exactly what the per-sequence path reads: on a real prefill with
prefix-cache hits and ragged prompts, the new-token segments are the packed row's ranges and
the contexts read back through ``kv_slots`` after the step equal each sequence's keys and
values as the per-sequence path takes them (cached pages + new tokens). The kernel itself
runs on the GPU only: ``test_prefill_varlen_gpu.py``.
"""
from __future__ import annotations

import numpy as np
import torch
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine


def test_segments_and_contexts_match_the_per_sequence_reads():
    engine = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu", block_size=4,
                                          num_blocks=256))
    runner = engine.backend.runner
    g = np.random.default_rng(0)
    system = g.integers(4, 500, size=22).tolist()  # 5 full pages + 2 tokens: cached next time
    params = SamplingParams(temperature=0, max_tokens=2, stop_token_ids=())
    engine.generate([system + [7]], params)
    steps = []
    real = runner._prefill_inputs

    def capture(seqs):  # as the step sees them (pages are released when the call ends)
        built = real(seqs)
        ctx = built[2]
        steps.append(([(list(s.block_table), len(s), s.num_cached_tokens) for s in seqs], ctx,
                      runner._prefill_varlen(seqs, ctx.q_ranges, ctx.cached_lens),
                      runner._prefill_varlen(seqs[2:], [(0, len(seqs[2]))], [0])))
        return built

    runner._prefill_inputs = capture
    prompts = [system + g.integers(4, 500, size=n).tolist() for n in (3, 9)] + \
        [g.integers(4, 500, size=6).tolist()]
    engine.generate(prompts, params)
    seqs, ctx, segs, cold = steps[0]
    lens = [n for _, n, _ in seqs]
    assert [c for _, _, c in seqs] == [20, 20, 0]  # whole pages hit, one prompt cold
    new = [b - a for a, b in ctx.q_ranges]
    assert new == [n - c for _, n, c in seqs]
    assert segs.cu_q.tolist() == np.concatenate([[0], np.cumsum(new)]).tolist()
    assert segs.cu_k.tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    assert (segs.max_q, segs.max_k) == (max(new), max(lens))
    assert segs.kv_slots.dtype == torch.int64 and segs.kv_slots.numel() == segs.cu_k[-1]
    bounds = segs.cu_k.tolist()
    for layer in range(runner.num_layers):
        for kind in (0, 1):  # keys, values
            cache = runner.kv[layer, kind]
            flat = cache.view(-1, *cache.shape[2:])
            read = flat.index_select(0, segs.kv_slots)
            for i, (table, n, _) in enumerate(seqs):  # what _prefill_each reads for it
                want = cache[torch.tensor(table)].flatten(0, 1)[:n]
                torch.testing.assert_close(read[bounds[i]:bounds[i + 1]], want, rtol=0, atol=0)
    # nothing cached: no read-back, the step's new keys are the contexts
    assert cold.kv_slots is None and cold.cu_q.tolist() == cold.cu_k.tolist() == [0, new[2]]

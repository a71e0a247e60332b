"""The varlen prefill (one FlashAttention-2 call per layer for every sequence) against the
per-sequence SDPA path in fp32, on random inputs: ragged new tokens after cached prefixes of
0-5 pages (causal aligned to the bottom right: a sequence's queries are the last of its keys),
full and sliding-window layers, GQA; bf16 and fp16. Its error against fp32 is at most the
per-sequence path's own error in that dtype, plus the dtype's rounding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from polynya.engines.sample.native import attention

pytestmark = pytest.mark.gpu
BS, HQ, HKV, D = 16, 8, 2, 64


def _case(dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    cached = [int(c) * BS for c in rng.integers(0, 6, size=7)]
    cached[0] = 0  # a cold prompt among cached ones
    new = [int(n) for n in rng.integers(1, 70, size=7)]
    tables, slots, ctx_slots, next_block = [], [], [], 1
    for c, n in zip(cached, new):
        blocks = list(range(next_block, next_block + -(-(c + n) // BS)))
        next_block += len(blocks)
        tables.append(torch.tensor(blocks, device="cuda"))
        pos = np.arange(c + n)
        flat = np.asarray(blocks)[pos // BS] * BS + pos % BS
        ctx_slots.append(flat)
        slots.append(flat[c:])
    kc = torch.randn(next_block, BS, HKV, D, device="cuda", generator=g).to(dtype)
    vc = torch.randn(next_block, BS, HKV, D, device="cuda", generator=g).to(dtype)
    t = sum(new)
    q = torch.randn(t, HQ, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(t, HKV, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(t, HKV, D, device="cuda", generator=g).to(dtype)
    slot_t = torch.from_numpy(np.concatenate(slots)).cuda()
    attention.write_kv(kc, vc, slot_t, k, v)
    ranges = np.concatenate([[0], np.cumsum(new)])
    ctx = attention.StepContext([(kc, vc)], slot_t, is_prefill=True,
                                q_ranges=list(zip(ranges[:-1].tolist(), ranges[1:].tolist())),
                                cached_lens=cached,
                                prefill_tables=[tb if c else None for tb, c in zip(tables, cached)])
    ctx.varlen = attention.prefill_varlen(new, cached, lambda: np.concatenate(ctx_slots),
                                          lambda a, dt: torch.from_numpy(a).to("cuda", dt))
    return q, k, v, kc, vc, ctx


def _per_sequence(q, k, v, kc, vc, ctx, window):
    plain = attention.StepContext(ctx.kv_caches, ctx.slot_mapping, True, ctx.q_ranges,
                                  ctx.cached_lens, ctx.prefill_tables)
    return attention._prefill(q, k, v, kc, vc, plain, None, window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 8, 40])
def test_varlen_prefill_equals_the_per_sequence_path(dtype, window):
    for seed in range(3):
        q, k, v, kc, vc, ctx = _case(dtype, seed)
        assert ctx.varlen.kv_slots is not None
        got = attention._prefill(q, k, v, kc, vc, ctx, None, window)
        same = _per_sequence(q, k, v, kc, vc, ctx, window)
        ref = _per_sequence(*(x.float() for x in (q, k, v, kc, vc)), ctx, window)
        err = (got.float() - ref).abs().max().item()
        own = (same.float() - ref).abs().max().item()
        eps = torch.finfo(dtype).eps
        assert err <= 2 * own + 4 * eps, (seed, err, own)


def test_nothing_cached_takes_the_new_keys():
    q, k, v, kc, vc, ctx = _case(torch.bfloat16, 7)
    ctx.cached_lens = [0] * len(ctx.cached_lens)
    ctx.prefill_tables = [None] * len(ctx.cached_lens)
    new = [b - a for a, b in ctx.q_ranges]
    ctx.varlen = attention.prefill_varlen(new, ctx.cached_lens, None,
                                          lambda a, dt: torch.from_numpy(a).to("cuda", dt))
    assert ctx.varlen.kv_slots is None
    got = attention._prefill(q, k, v, kc, vc, ctx, None)
    ref = _per_sequence(*(x.float() for x in (q, k, v, kc, vc)), ctx, None)
    same = _per_sequence(q, k, v, kc, vc, ctx, None)
    assert (got.float() - ref).abs().max() <= 2 * (same.float() - ref).abs().max() + 0.02

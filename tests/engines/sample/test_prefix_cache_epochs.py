"""Prefix-cache resets (new weights, ``reset_prefix_cache``) with sequences running across them
(tiny:qwen3, fp32, CPU): a sequence allocated before a reset holds KV computed, at least in part,
with what the reset invalidated, so none of its pages may be keyed after it — its first page
included, which has no chain to cut — and a later prompt starting with its tokens must compute
them (HF greedy with the new weights is the oracle)."""
from __future__ import annotations

import pytest
import torch
from polynya import SamplingParams
from polynya.engines.sample.native.block_manager import BlockManager
from polynya.models import load_model

from .test_block_manager import seq
from .test_failed_steps import assert_consistent, greedy, queue
from .test_native_engine import make_engine


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_page_of_a_sequence_running_across_a_weight_load_is_keyed(async_scheduling, n):
    """A's prompt is shorter than a page: its prefill ran on the old weights, its first page
    fills on the new ones (per fork, after copy-on-write with n = 2). The old engine keyed that
    page, and B — A's first tokens and one more — took 4 tokens of old-weight KV from it."""
    engine = make_engine(async_scheduling=async_scheduling)
    eng = engine.backend
    new = load_model("tiny:qwen3", dtype="float32", seed=1)
    pa = [11, 22]
    p = SamplingParams(n=n, temperature=0, max_tokens=6, stop_token_ids=())
    (ra,) = queue(eng, [pa], p)
    with eng._lock:
        eng.step()  # the prefill, on the old weights
    eng.load_weights(dict(new.named_parameters()))
    a = eng.wait([ra])[0]
    assert all(len(s.token_ids) == 6 for s in a)
    assert not eng.block_manager.key, "a page holding old-weight KV was keyed"
    assert_consistent(eng)
    pb = pa + a[0].token_ids[:2] + [33]
    hits = engine.stats()["cache_hit_tokens"]
    out = engine.generate([pb], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=()))
    assert engine.stats()["cache_hit_tokens"] == hits
    assert out[0][0].token_ids == greedy(new, pb, 6)
    assert eng.block_manager.key  # a sequence allocated after the load keys its pages


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reset_prefix_cache_between_steps(async_scheduling):
    """``reset_prefix_cache`` while a request decodes (a step in flight with async scheduling:
    booked first): the cache is empty after it and the running request keys nothing more; its
    tokens are those of a run without the reset (same weights)."""
    engine = make_engine(async_scheduling=async_scheduling)
    eng = engine.backend
    prompt = list(range(40, 49))
    p = SamplingParams(n=2, temperature=0, max_tokens=12, stop_token_ids=())
    (rid,) = queue(eng, [prompt], p)
    with eng._lock:
        for _ in range(3):
            eng.step()
    assert eng.block_manager.key
    eng.reset_prefix_cache()
    assert eng._inflight is None and not eng.block_manager.key
    out = eng.wait([rid])[0]
    assert not eng.block_manager.key
    assert [s.token_ids for s in out] == [s.token_ids for s in make_engine().generate([prompt], p)[0]]


def test_commit_keys_no_page_of_an_older_epoch():
    """Block manager alone: after a reset, a sequence (and a fork of it) allocated before keys
    no page, its first included; one allocated after keys them, and so do its forks."""
    bm = BlockManager(16, 4)
    old = seq([1, 2, 3])
    bm.allocate(old)
    bm.reset_prefix_cache()
    kid = old.fork(1, torch.Generator())
    bm.fork(old, kid)
    for s, tok in ((old, 7), (kid, 8)):
        s.token_ids.append(tok)
        bm.append_slot(s)
        bm.commit(s, 4)
    assert not bm.key and not bm.hash_to_block

    fresh = seq([1, 2, 3, 4, 5, 6])
    bm.allocate(fresh)
    assert set(bm.key) == {fresh.block_table[0]}
    child = fresh.fork(1, torch.Generator())
    bm.fork(fresh, child)
    child.token_ids += [9, 10]
    bm.append_slot(child)  # copy-on-write of the shared partial page
    bm.commit(child, 8)
    assert child.block_table[1] in bm.key
    again = seq(child.token_ids + [0])
    bm.allocate(again)
    assert again.num_cached_tokens == 8

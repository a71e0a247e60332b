"""Block manager and scheduler: prefix hits, forks, copy-on-write, LRU revival, preemption."""
from __future__ import annotations

import torch
from polynya import SamplingParams
from polynya.engines.sample.native.block_manager import BlockManager
from polynya.engines.sample.native.scheduler import Scheduler
from polynya.engines.sample.native.sequence import Sequence

BS = 4


def seq(tokens: list[int], n: int = 1) -> Sequence:
    return Sequence(token_ids=list(tokens), num_prompt_tokens=len(tokens), params=SamplingParams(n=n),
                    stop_ids=frozenset(), generator=torch.Generator(), request_id=0, pending_forks=n - 1)


def test_prefix_hit_shares_full_blocks_only():
    bm = BlockManager(16, BS)
    a = seq(list(range(10)))  # blocks: [0-3] [4-7] [8,9]
    bm.allocate(a)
    assert a.num_cached_tokens == 0 and len(a.block_table) == 3
    b = seq(list(range(8)) + [50, 51, 52])  # same two full blocks, different tail
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8
    assert [bm.ref_count[i] for i in a.block_table] == [2, 2, 1]


def test_last_token_block_is_recomputed():
    """A fully cached prompt still computes its last block (the logits need its last token)."""
    bm = BlockManager(16, BS)
    a = seq(list(range(8)))
    bm.allocate(a)
    b = seq(list(range(8)))
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]


def test_freed_blocks_revive_from_cache_and_reset_clears():
    bm = BlockManager(8, BS)
    a = seq(list(range(9)))
    bm.allocate(a)
    table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free == 8
    b = seq(list(range(9)))
    assert bm.blocks_needed(b) == 3  # 2 revived + 1 new
    bm.allocate(b)
    assert b.block_table[:2] == table[:2] and b.num_cached_tokens == 8
    bm.deallocate(b)
    bm.reset_prefix_cache()
    c = seq(list(range(9)))
    bm.allocate(c)
    assert c.num_cached_tokens == 0


def test_fork_copy_on_write_and_commit():
    bm = BlockManager(16, BS)
    parent = seq(list(range(6)), n=3)  # [0-3] full, [4,5] partial
    bm.allocate(parent)
    kids = [parent.fork(j, torch.Generator()) for j in (1, 2)]
    for k in kids:
        bm.fork(parent, k)
    assert [bm.ref_count[i] for i in parent.block_table] == [3, 3]
    copies = []
    for s, tok in zip([parent, *kids], (10, 11, 12)):
        s.token_ids.append(tok)  # token 6 goes into the shared partial block
        assert bm.needs_block(s) == (bm.ref_count[s.block_table[1]] > 1)
        copies.append(bm.append_slot(s))
    assert copies[0] is not None and copies[1] is not None and copies[2] is None  # last owner keeps it
    assert copies[0][0] == copies[1][0] and len({parent.block_table[1], kids[0].block_table[1],
                                                 kids[1].block_table[1]}) == 3
    assert kids[1].block_table[1] == copies[0][0]  # the last owner writes the original page
    assert all(s.block_table[0] == parent.block_table[0] for s in kids)  # full block still shared
    # filling the block keys it for prefix caching
    for s in (parent, *kids):
        s.token_ids.append(20)
        bm.append_slot(s)
        bm.commit(s, 8)
    assert parent.block_table[1] in bm.key
    again = seq(parent.token_ids[:8] + [1])
    bm.allocate(again)
    assert again.num_cached_tokens == 8 and again.block_table[1] == parent.block_table[1]


def test_scheduler_preempts_newest_and_loses_nothing():
    bm = BlockManager(6, BS)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [seq([i * 10 + j for j in range(7)]) for i in range(3)]  # 2 blocks each
    for s in seqs:
        sch.add(s)
    batch = sch.schedule()
    assert batch.is_prefill and batch.seqs == seqs and bm.num_free == 0
    sch.confirm()  # the prefill was read back
    for s in seqs:
        s.token_ids += [1, 2]  # each now needs a third block at the next decode
    batch = sch.schedule()
    assert not batch.is_prefill and sch.num_preemptions >= 1
    assert seqs[-1] in sch.waiting and seqs[-1].block_table == []
    assert set(map(id, batch.seqs)) | set(map(id, sch.waiting)) == set(map(id, seqs))


def test_shares_pages_detects_forks_and_prefix_hits_only():
    from polynya.engines.sample.native.model_runner import ModelRunner

    bm = BlockManager(32, BS)
    a, b = seq(list(range(9))), seq(list(range(100, 109)))
    bm.allocate(a)
    bm.allocate(b)
    assert not ModelRunner.shares_pages([a, b])
    c = seq(list(range(9)))  # same prompt: its first two pages come from the prefix cache
    bm.allocate(c)
    assert ModelRunner.shares_pages([a, b, c])
    short = seq([1, 2])  # forks of a one-page prompt stop sharing once each copies on write
    bm.allocate(short)
    kid = short.fork(1, torch.Generator())
    bm.fork(short, kid)
    assert ModelRunner.shares_pages([short, kid])
    for s in (short, kid):
        s.token_ids.append(3)
        bm.append_slot(s)
    assert not ModelRunner.shares_pages([short, kid])

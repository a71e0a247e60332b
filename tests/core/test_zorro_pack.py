import random

import numpy as np
import pytest
from polynya import RolloutBatch
from polynya.zorro import build_forest, pack_rows
from polynya.zorro.attention import dense_mask
from polynya.zorro.tree import MIN_SHARED_TOKENS

from .batches import random_batch


@pytest.mark.parametrize("seed", range(5))
def test_forest_stores_every_sequence_exactly(seed):
    rng = random.Random(seed)
    seqs = [np.array([rng.randrange(4) for _ in range(rng.randint(1, 9))]) for _ in range(30)]
    f = build_forest(seqs)
    for s, pos in zip(seqs, f.sample_pos):
        assert np.array_equal(f.tokens[pos], s)
        assert np.array_equal(f.depth[pos], np.arange(s.size))
    # deduplication is maximal: the forest has exactly one token per distinct prefix
    prefixes = {tuple(s[: k + 1]) for s in seqs for k in range(s.size)}
    assert f.num_tokens == len(prefixes)


def test_shared_system_prompt_and_identical_prompts_are_stored_once():
    sys_ = [1, 2, 3, 4]
    b = RolloutBatch([sys_ + [5], sys_ + [5], sys_ + [6, 7], [9]], [[10], [11], [10], [12]])
    f = build_forest([np.concatenate([p, r]) for p, r in zip(b.prompts, b.responses)])
    assert f.num_tokens == 4 + 1 + 2 + 2 + 1 + 2  # sys, q1, r1, r2, q2 (2) + r3, [9] + r4
    assert len(set(f.sample_root.tolist())) == 2


@pytest.mark.parametrize("seed", range(4))
def test_dense_mask_matches_prefix_visibility(seed):
    rng = random.Random(seed)
    batch = random_batch(rng, vocab=6, groups=3, max_group=3, max_prompt=4, max_response=3)
    rows = pack_rows(batch, max_tokens_per_row=20, pad_multiple=8)
    mask = dense_mask(rows.tin, rows.tout)[:, 0]
    seqs = [np.concatenate([p, r]) for p, r in zip(batch.prompts, batch.responses)]
    flat_len = rows.input_ids.shape[1]
    # map forest token -> flat row index through the packed ids/positions of each sample
    for a, sa in enumerate(seqs):
        pa = rows.pred_index[rows.out_row == a]  # flat positions predicting sample a's response
        for i_tok, flat_i in zip(range(batch.prompts[a].size - 1, sa.size - 1), pa.tolist()):
            r, qi = divmod(flat_i, flat_len)
            assert rows.position_ids[r, qi] == i_tok
            seen = mask[r, qi].nonzero().flatten().tolist()
            # what it sees must be exactly the sample's own prefix tokens 0..i_tok
            assert sorted(rows.position_ids[r, seen].tolist()) == list(range(i_tok + 1))
            assert rows.input_ids[r, seen].tolist() == [int(t) for t in sa[: i_tok + 1]]
    assert mask.any(-1).all(), "every query, padding included, must see at least itself"


def test_rows_respect_budget_and_never_split_groups():
    rng = random.Random(0)
    batch = random_batch(rng, vocab=50, groups=6, with_group_ids=True, system_prompt=False)
    rows = pack_rows(batch, max_tokens_per_row=40)
    flat_len = rows.input_ids.shape[1]
    row_of_sample = {}
    for i, idx in zip(rows.out_row.tolist(), rows.pred_index.tolist()):
        row_of_sample.setdefault(i, set()).add(idx // flat_len)
    for g in set(batch.group_ids):
        members = [i for i, gid in enumerate(batch.group_ids) if gid == g]
        assert len(set().union(*(row_of_sample[i] for i in members))) == 1


def test_rows_split_shared_prefix_by_group_and_repeat_it():
    """Three groups share a system prompt: with a row budget they get rows of their own, each
    row carrying its own copy of it; log-prob inputs still address the right tokens."""
    head = list(range(100, 100 + MIN_SHARED_TOKENS))  # long enough to be shared
    b = RolloutBatch([head + [5], head + [5], head + [6], head + [7, 8]], [[9], [10], [9], [11]])
    one = pack_rows(b)
    assert one.input_ids.shape[0] == 1 and one.num_real_tokens == len(head) + 1 + 2 + 1 + 1 + 2 + 1
    rows = pack_rows(b, max_tokens_per_row=len(head) + 3)
    assert rows.input_ids.shape[0] >= 2
    assert rows.num_real_tokens > one.num_real_tokens  # the head is repeated per row
    for r in range(rows.input_ids.shape[0]):
        assert rows.input_ids[r, :len(head)].tolist() == head
    flat = rows.input_ids.reshape(-1)
    for i, (p, resp) in enumerate(zip(b.prompts, b.responses)):
        at = rows.pred_index[rows.out_row == i]
        assert flat[at].tolist() == [int(p[-1])] and rows.pred_target[rows.out_row == i].tolist() == resp.tolist()


def test_short_head_of_different_prompts_is_repeated_not_shared():
    """A chat template's dozen tokens before different prompts: ZoRRo's layout repeats them per
    prompt group (no tree spans the groups, so no token gets an extra attention partial), while
    each group's prompt is still stored once for its G responses."""
    header = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    prompts = [header + [20 + g] * 80 for g in range(3)]
    b = RolloutBatch([p for p in prompts for _ in range(4)], [[50 + k, 60] for k in range(12)])
    rows = pack_rows(b)
    assert rows.num_real_tokens == 3 * (len(header) + 80) + 12 * 2
    _, ends, stops = rows.nodes.T
    inner = rows.nodes[stops > ends]
    assert len(inner) == 3 and set((inner[:, 1] - inner[:, 0]).tolist()) == {len(header) + 80}
    maximal = build_forest([np.concatenate([p, r]) for p, r in zip(b.prompts, b.responses)])
    assert maximal.num_tokens == len(header) + 3 * 80 + 12 * 2  # maximal sharing: one tree
    assert len(set(maximal.sample_root.tolist())) == 1
    # a header of MIN_SHARED_TOKENS tokens is worth sharing again
    long = [list(range(100, 100 + MIN_SHARED_TOKENS)) + [20 + g] * 80 for g in range(3)]
    b2 = RolloutBatch([p for p in long for _ in range(4)], [[50 + k, 60] for k in range(12)])
    assert pack_rows(b2).num_real_tokens == MIN_SHARED_TOKENS + 3 * 80 + 12 * 2


def _random_headed(rng: random.Random) -> RolloutBatch:
    """Groups whose prompts start with heads of random lengths around MIN_SHARED_TOKENS (some
    nested: a header, then a system prompt for some groups), ragged responses sharing first
    tokens, one prompt group repeated under another group id."""
    vocab = 6
    header = [rng.randrange(vocab) for _ in range(rng.randint(1, 2 * MIN_SHARED_TOKENS))]
    system = [rng.randrange(vocab) for _ in range(rng.randint(1, 2 * MIN_SHARED_TOKENS))]
    prompts, responses, gids = [], [], []
    for g in range(rng.randint(2, 7)):
        q = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        prompt = header + (system if rng.random() < 0.5 else []) + q or [1]
        for _ in range(rng.randint(1, 4)):
            prompts.append(prompt)
            responses.append([rng.randrange(3) for _ in range(rng.randint(1, 6))])
            gids.append(g)
    return RolloutBatch(prompts, responses, group_ids=gids)


@pytest.mark.parametrize("seed", range(40))
def test_unsharing_short_heads_is_exact_and_keeps_the_planner_an_upper_bound(seed):
    """With ``MIN_SHARED_TOKENS``: every sequence's tokens and positions are exact; no head of
    different prompts (a node inside every prompt below it) is shorter than the threshold; every
    prompt group's prompt is stored once (unless another prompt continues it); and a part's own
    forest never has more tokens than the planner's count for it (the union of its samples'
    positions in the whole batch's forest), so row budgets hold."""
    rng = random.Random(seed)
    b = _random_headed(rng)
    seqs = [np.concatenate([p, r]) for p, r in zip(b.prompts, b.responses)]
    plens = [p.size for p in b.prompts]
    f = build_forest(seqs, plens, MIN_SHARED_TOKENS)
    for s, pos in zip(seqs, f.sample_pos):
        assert np.array_equal(f.tokens[pos], s) and np.array_equal(f.depth[pos], np.arange(s.size))
    for k in range(f.node_len.size):
        if not (f.node_parent == k).any():
            continue
        branch = int(f.depth[f.node_offset[k] + f.node_len[k] - 1]) + 1  # depth where they part
        below = [i for i, pos in enumerate(f.sample_pos) if np.isin(f.node_offset[k], pos)]
        if all(branch < plens[i] for i in below):  # a head of different prompts
            assert f.node_len[k] >= MIN_SHARED_TOKENS
    prompts = {tuple(p.tolist()) for p in b.prompts}
    for g in set(b.group_ids):
        rows = [i for i, x in enumerate(b.group_ids) if x == g]
        mine = tuple(b.prompts[rows[0]].tolist())
        if any(len(p) > len(mine) and p[:len(mine)] == mine for p in prompts):
            continue  # a prompt that another prompt continues (no chat template allows that)
        prompt_pos = {tuple(f.sample_pos[i][:plens[i]].tolist()) for i in rows}
        assert len(prompt_pos) == 1  # the group's prompt once for all its responses
    groups = sorted(set(b.group_ids))
    for _ in range(6):
        pick = set(rng.sample(groups, rng.randint(1, len(groups))))
        part = [i for i, g in enumerate(b.group_ids) if g in pick]
        planned = np.unique(np.concatenate([f.sample_pos[i] for i in part])).size
        own = build_forest([seqs[i] for i in part], [plens[i] for i in part], MIN_SHARED_TOKENS)
        assert own.num_tokens <= planned
    with pytest.raises(ValueError, match="prompt_lens"):
        build_forest(seqs, None, MIN_SHARED_TOKENS)
    with pytest.raises(ValueError, match="one per sequence"):
        build_forest(seqs, plens[:-1], MIN_SHARED_TOKENS)
    with pytest.raises(ValueError, match=r"prompt_lens\[0\] = .* not within"):
        build_forest(seqs, [seqs[0].size + 1] + plens[1:], MIN_SHARED_TOKENS)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="min_shared must be an int >= 1"):
            build_forest(seqs, plens, bad)
    assert plens == [p.size for p in b.prompts]  # the caller's list is left as it was


def test_unsharing_is_monotone_on_small_forests():
    """The planner bound on many small forests (3 token values, threshold 4: heads, prefixes of
    other prompts, sequences ending where others branch — the cases a non-monotone rule gets
    wrong): any subset's own forest has no more tokens than its positions in the whole one."""
    for seed in range(3000):
        rng = random.Random(seed)
        header = [rng.randrange(3) for _ in range(rng.randint(0, 6))]
        system = [rng.randrange(3) for _ in range(rng.randint(0, 6))]
        seqs, plens = [], []
        for _ in range(rng.randint(2, 4)):
            p = header + (system if rng.random() < 0.5 else []) + [rng.randrange(3) for _ in range(rng.randint(0, 4))]
            p = p or [1]
            for _ in range(rng.randint(1, 3)):
                seqs.append(np.array(p + [rng.randrange(2) for _ in range(rng.randint(1, 3))]))
                plens.append(len(p))
        f = build_forest(seqs, plens, 4)
        for _ in range(4):
            part = sorted(rng.sample(range(len(seqs)), rng.randint(1, len(seqs))))
            planned = np.unique(np.concatenate([f.sample_pos[i] for i in part])).size
            own = build_forest([seqs[i] for i in part], [plens[i] for i in part], 4)
            assert own.num_tokens <= planned, (seed, part)
            for i, pos in zip(part, own.sample_pos):
                assert np.array_equal(own.tokens[pos], seqs[i])


@pytest.mark.parametrize("seed,block,window", [(0, 8, None), (1, 8, None), (2, 16, None),
                                               (3, 4, None), (4, 4, 5), (5, 8, 11), (6, 4, 1)])
def test_interval_block_mask_equals_flex_create_block_mask(seed, block, window):
    """The compile-free BlockMask builder classifies every block pair as FlexAttention's own
    ``create_block_mask`` does, and its mask_mod is the dense rule (multiple rows, padding,
    sliding windows by position)."""
    import torch
    from polynya.zorro.attention import interval_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    rng = random.Random(seed)
    batch = random_batch(rng, vocab=6, groups=4, max_group=4, max_prompt=12, max_response=9)
    rows = pack_rows(batch, max_tokens_per_row=48, pad_multiple=block)
    tin, tout = rows.tin, rows.tout
    length = tin.shape[1]
    pos = rows.position_ids
    ours = interval_block_mask(tin, tout, block, pos, window)
    dense = dense_mask(tin, tout, pos, window)[:, 0]
    if window is not None:  # the window drops keys only by position distance
        full = dense_mask(tin, tout)[:, 0]
        far = pos[:, :, None] - pos[:, None, :] >= window
        assert torch.equal(dense, full & ~far) and (full & far).any()

    def mm(b, h, q, k):
        return dense[b, q, k]

    ref = create_block_mask(mm, tin.shape[0], None, length, length, device="cpu",
                            BLOCK_SIZE=block, _compile=False)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        n = getattr(ours, num)
        for b in range(n.shape[0]):
            for qb in range(n.shape[2]):
                k = int(n[b, 0, qb])
                assert sorted(getattr(ours, idx)[b, 0, qb, :k].tolist()) == \
                    sorted(getattr(ref, idx)[b, 0, qb, :k].tolist())
    q, k = torch.meshgrid(torch.arange(length), torch.arange(length), indexing="ij")
    for b in range(tin.shape[0]):
        assert torch.equal(ours.mask_mod(torch.tensor(b), 0, q, k), dense[b])
    assert ours.kv_num_blocks.sum() > 0
    if block < 16 and window is None:  # small blocks: some lie inside a prompt read by all
        assert ours.full_kv_num_blocks.sum() > 0


def test_interval_block_mask_rejects_bad_shapes():
    import torch
    from polynya.zorro.attention import interval_block_mask

    tin = torch.zeros(1, 24, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 16"):
        interval_block_mask(tin, tin, 16)
    with pytest.raises(ValueError, match=r"\[rows, length\]"):
        interval_block_mask(tin, tin[:, :16], 8)

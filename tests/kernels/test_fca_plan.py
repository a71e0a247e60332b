"""plan_forest: the forest it finds and the work lists it emits, on handcrafted and random forests.

Every test checks the plan's invariants (each valid cell of each request covered exactly once,
shared items only over blocks their members really share, slots 0..n-1 per request) and runs
the plan through a plain-torch executor against the fp32 reference, so a wrong plan cannot
pass. GPU tests compare the planner on CUDA (the Triton launches) with the torch one at real sizes.
"""
from __future__ import annotations

import math

import pytest
import torch
from polynya.kernels.fca import ForestPlan, plan_forest
from polynya.kernels.fca.plan import _classes_torch
from polynya.kernels.fca.reference import paged_decode_reference
from polynya.kernels.fca.testing import build_forest, plan_difference

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def plan_items(plan: ForestPlan):
    """(row, c0, c1, slot, members) for every live shared item, on the host."""
    items = []
    for i in range(int(plan.n_shared.item())):
        n = int(plan.sh_nmem[i])
        items.append((int(plan.sh_row[i]), int(plan.sh_c0[i]), int(plan.sh_c1[i]),
                      int(plan.sh_slot[i]), plan.sh_mem[i, :n].tolist()))
    return items


def check_invariants(plan: ForestPlan, bt: torch.Tensor, seq_lens: torch.Tensor, bs: int):
    """Shared items only over blocks all members hold (full); per request, shared columns
    plus the private virtual row cover every valid column exactly once, in order."""
    bt, seq_lens = bt.cpu(), seq_lens.cpu()
    B, MB = bt.shape
    cover = torch.zeros(B, MB, dtype=torch.int32)
    slots: dict[int, list[int]] = {b: [] for b in range(B)}
    for row, c0, c1, slot, members in plan_items(plan):
        assert 0 <= c0 < c1 <= MB
        assert len(members) == len(set(members)) >= 1
        assert row in members and len(members) <= plan.max_group
        for m in members:  # members hold the same full blocks as the row
            assert torch.equal(bt[m, c0:c1], bt[row, c0:c1])
            assert c1 * bs <= int(seq_lens[m])
            cover[m, c0:c1] += 1
            slots[m].append(slot)
    assert int(cover.max()) <= 1
    ncols = (seq_lens + bs - 1) // bs
    valid = torch.arange(MB)[None, :] < ncols[:, None]
    assert not bool((cover.bool() & ~valid).any())
    pv_bt, pv_len, n_sh = plan.pv_bt.cpu(), plan.pv_len.cpu(), plan.n_sh_slots.cpu()
    for b in range(B):
        assert sorted(slots[b]) == list(range(int(n_sh[b])))
        assert int(n_sh[b]) <= plan.max_shared_slots
        priv_cols = [j for j in range(int(ncols[b])) if not cover[b, j]]
        assert int(pv_len[b]) == int(seq_lens[b]) - bs * int(cover[b].sum())
        assert -(-int(pv_len[b]) // bs) == len(priv_cols)
        assert pv_bt[b, :len(priv_cols)].tolist() == bt[b, priv_cols].tolist()


def execute_plan(plan: ForestPlan, q, k, v, scale=None):
    """Run a plan with plain torch: one partial per (item, member), one per private row,
    exact LSE merge."""
    B, Hq, D = q.shape
    bs, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {b: [] for b in range(B)}

    def attend(b, ids, n):
        kk = k[ids].reshape(-1, Hkv, D).float().repeat_interleave(Hq // Hkv, 1)[:n]
        vv = v[ids].reshape(-1, Hkv, D).float().repeat_interleave(Hq // Hkv, 1)[:n]
        s = torch.einsum("hd,thd->ht", q[b].float(), kk) * scale
        lse = torch.logsumexp(s, -1)
        parts[b].append((torch.einsum("ht,thd->hd", torch.exp(s - lse[:, None]), vv), lse))

    for row, c0, c1, _, members in plan_items(plan):
        ids = plan.block_tables[row, c0:c1].long().cpu()
        for m in members:
            attend(m, ids, (c1 - c0) * bs)
    for b in range(B):
        n = int(plan.pv_len[b])
        if n:
            attend(b, plan.pv_bt[b, :-(-n // bs)].long().cpu(), n)
    out = torch.empty(B, Hq, D)
    for b in range(B):
        lses = torch.stack([p[1] for p in parts[b]])
        w = torch.softmax(lses, 0)
        out[b] = sum(w[i][:, None] * p[0] for i, p in enumerate(parts[b]))
    return out


def shared_member_rows(plan: ForestPlan) -> int:
    return sum(len(it[4]) for it in plan_items(plan))


FORESTS = {
    "one_level": [(2, 24), (3, (5, 11))],
    "three_level": [(1, 16), (3, 12), (2, (1, 9))],
    "singletons": [(5, (3, 30))],
    "unaligned": [(2, 13), (3, 7), (2, (1, 6))],
    "deep": [(1, 8), (2, 8), (1, 8), (2, 8), (2, 5)],
}


@pytest.mark.parametrize("name", sorted(FORESTS))
@pytest.mark.parametrize("chunk", [8, 64])
def test_plan_random_forests(name, chunk):
    bs = 4
    bt, sl, nb = build_forest(FORESTS[name], bs, seed=len(name))
    plan = plan_forest(bt, sl, bs, min_shared_tokens=4, chunk_tokens=chunk, max_group=2)
    check_invariants(plan, bt, sl, bs)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(bt.shape[0], 4, 8, generator=g)
    k, v = torch.randn(nb, bs, 2, 8, generator=g), torch.randn(nb, bs, 2, 8, generator=g)
    ref = paged_decode_reference(q, k, v, bt, sl)
    torch.testing.assert_close(execute_plan(plan, q, k, v), ref, atol=1e-5, rtol=1e-5)
    if name == "singletons":
        assert int(plan.n_shared.item()) == 0
    else:
        assert int(plan.n_shared.item()) > 0


def test_three_level_forest_is_found():
    """System prompt (2 full blocks) -> 3 prompts (1 block + a 2-token tail) -> 2 samples."""
    bs = 4
    bt, sl, _ = build_forest([(1, 8), (3, 6), (2, 5)], bs, shuffle=True, seed=3)
    plan = plan_forest(bt, sl, bs, min_shared_tokens=4, chunk_tokens=1024)
    check_invariants(plan, bt, sl, bs)
    shared = sorted((c0, c1, len(m)) for _, c0, c1, _, m in plan_items(plan))
    # root: columns 0..2 for all 6; each prompt: column 2 for its 2 samples (its tail block
    # was copied into the samples' own blocks, so it is not shared).
    assert shared == [(0, 2, 6), (2, 3, 2), (2, 3, 2), (2, 3, 2)]
    assert plan.n_sh_slots.tolist() == [2] * 6
    assert plan.pv_len.tolist() == (sl - 12).tolist()


def test_cost_model_sends_short_prefixes_and_singletons_to_plain_path():
    bs = 4
    bt, sl, _ = build_forest([(2, 8), (4, 9)], bs, seed=5)
    plan = plan_forest(bt, sl, bs, min_shared_tokens=12)  # prefix of 8 tokens: too short
    check_invariants(plan, bt, sl, bs)
    assert int(plan.n_shared.item()) == 0
    plan = plan_forest(bt, sl, bs, min_shared_tokens=8)
    assert shared_member_rows(plan) == 8
    bt1, sl1, _ = build_forest([(6, 40)], bs, seed=6)  # groups of one
    plan1 = plan_forest(bt1, sl1, bs, min_shared_tokens=0)
    assert int(plan1.n_shared.item()) == 0
    check_invariants(plan1, bt1, sl1, bs)


def test_max_levels_bounds_slots():
    bs = 2
    levels = [(1, 2)] + [(2, 2)] * 5 + [(1, 3)]
    bt, sl, _ = build_forest(levels, bs, seed=7)
    for max_levels in (1, 2, 6):
        plan = plan_forest(bt, sl, bs, min_shared_tokens=2, chunk_tokens=1024,
                           max_levels=max_levels)
        check_invariants(plan, bt, sl, bs)
        assert int(plan.n_sh_slots.max()) == min(max_levels, 5)


def test_large_groups_split_into_tiles():
    bs = 4
    bt, sl, _nb = build_forest([(1, 16), (11, (1, 7))], bs, seed=8)
    plan = plan_forest(bt, sl, bs, min_shared_tokens=4, max_group=4)
    check_invariants(plan, bt, sl, bs)
    sizes = sorted(len(it[4]) for it in plan_items(plan))
    assert sizes == [3, 4, 4]


def test_block_tables_padding_and_int64():
    bs = 4
    bt, sl, _ = build_forest([(2, 8), (2, 3)], bs, seed=9)
    bt = torch.cat([bt, torch.full((bt.shape[0], 3), 123456, dtype=torch.int32)], 1)
    plan = plan_forest(bt.long(), sl.long(), bs, min_shared_tokens=4)
    check_invariants(plan, bt, sl, bs)
    assert plan.block_id_range.tolist()[1] < 123456


def test_classes_match_bruteforce():
    bs = 4
    bt, sl, _ = build_forest([(2, 9), (3, 8), (2, (1, 9))], bs, seed=10)
    MB = bt.shape[1]
    full = (torch.arange(MB)[None, :] + 1) * bs <= sl[:, None]
    cnt, rep, rank = _classes_torch(bt, full)
    for b in range(bt.shape[0]):
        for j in range(MB):
            members = [c for c in range(bt.shape[0])
                       if full[b, :j + 1].all() and full[c, :j + 1].all()
                       and torch.equal(bt[b, :j + 1], bt[c, :j + 1])]
            assert cnt[b, j] == len(members)
            if members:
                assert rep[b, j] == min(members)
                assert rank[b, j] == sum(c < b for c in members)


@pytest.mark.parametrize("bad", ["seq0", "seqbig", "shape", "dtype", "bs", "rows"])
def test_plan_errors(bad):
    bt, sl, _ = build_forest([(2, 8), (2, 3)], 4, seed=11)
    kw = {"block_tables": bt, "seq_lens": sl, "block_size": 4}
    if bad == "seq0":
        sl[1] = 0
    elif bad == "seqbig":
        sl[0] = bt.shape[1] * 4 + 1
    elif bad == "shape":
        kw["block_tables"] = bt[0]
    elif bad == "dtype":
        kw["block_tables"] = bt.float()
    elif bad == "bs":
        kw["block_size"] = 0
    elif bad == "rows":
        kw["seq_lens"] = sl[:-1]
    with pytest.raises(ValueError):
        plan_forest(**kw)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("levels", [[(8, 4096), (16, 512)], [(1, 2048), (64, 512), (8, 512)],
                                    [(3, (100, 900)), (5, (1, 300)), (3, (1, 200))]])
def test_plan_gpu_matches_cpu(levels):
    bs = 16
    bt, sl, _ = build_forest(levels, bs, seed=12)
    plan_gpu = plan_forest(bt.cuda(), sl.cuda(), bs)
    plan_cpu = plan_forest(bt, sl, bs)
    diff = plan_difference(plan_cpu, plan_gpu)  # past n_shared: scratch, not compared
    assert diff is None, diff
    if bt.shape[0] <= 200:
        check_invariants(plan_gpu, bt, sl, bs)


def test_plan_difference_names_the_first_differing_field():
    bt, sl, _ = build_forest([(2, 24), (3, (5, 11))], 4, seed=3)
    plan = plan_forest(bt, sl, 4, min_shared_tokens=4)
    assert plan_difference(plan, plan_forest(bt, sl, 4, min_shared_tokens=4)) is None
    other = plan_forest(bt, sl, 4, min_shared_tokens=4)
    other.pv_len = other.pv_len + 1
    assert plan_difference(plan, other).startswith("pv_len: ")
    other = plan_forest(bt, sl, 4, min_shared_tokens=4)
    n = int(other.n_shared.item())
    assert n > 0
    other.sh_c0 = other.sh_c0.clone()
    other.sh_c0[n:] += 7  # scratch past n_shared: not compared
    assert plan_difference(plan, other) is None
    other.sh_c0[n - 1] += 1
    assert plan_difference(plan, other).startswith("sh_c0: ")

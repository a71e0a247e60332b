"""Triton kernels of the forest planner (``plan.py``), @triton.jit only.

Four launches build a step's :class:`~polynya.kernels.fca.plan.ForestPlan` from the block
tables, with no host synchronisation (they run inside the sampler's CUDA graphs):

1. ``_fca_classes_kernel`` — per cell (request b, column j): the size, smallest member and
   b's rank of b's class (requests whose rows equal b's on full blocks in columns ``0..j``);
2. ``_plan_rows_kernel`` — one program per request, three passes over its columns (not the table's width): node ends
   (right to left), the shared / start / slot / private-row bookkeeping (left to right), item
   ends (right to left); it also writes the request's private virtual row;
3. ``_plan_offsets_kernel`` — one program: each request's first item number (an exclusive
   prefix sum of the items its cells lead), the item count and the block-id range;
4. ``_plan_items_kernel`` — per (request, column tile): every start cell writes its request
   into its item's member list; a tile's first member writes the item's fields.

Each step mirrors one line group of the torch planner in ``plan.py`` (same names), which is
the oracle the tests compare against, field by field.
"""
import triton
import triton.language as tl


@triton.jit
def _fca_classes_kernel(bt_ptr, sl_ptr, cnt_ptr, rep_ptr, rank_ptr, B, MB,
                        PAGE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """Planner, one program per (request b, column tile): for each column j of the tile,
    the class of b = requests c whose rows equal b's on full blocks in columns 0..j, i.e.
    whose first *miss* against b (a differing id, or a block of either row not full) lies
    past j. Only b's full columns up to the tile's end are compared (a tile past them is in
    no class: cnt 0), so the work grows with the requests' lengths, not the tables' width."""
    b = tl.program_id(0)
    jt = tl.program_id(1)
    offs_j = jt * BLOCK_J + tl.arange(0, BLOCK_J)
    jm = offs_j < MB
    full_b = tl.minimum(tl.load(sl_ptr + b) // PAGE, MB)
    j_end = tl.minimum((jt + 1) * BLOCK_J, full_b)
    n_b = tl.where(jt * BLOCK_J < full_b, B, 0)
    cnt = tl.zeros([BLOCK_J], tl.int32)
    rank = tl.zeros([BLOCK_J], tl.int32)
    rep = tl.full([BLOCK_J], B, tl.int32)
    for b0 in range(0, n_b, BLOCK_B):
        bb = b0 + tl.arange(0, BLOCK_B)
        bm = bb < B
        full_bb = tl.load(sl_ptr + bb, mask=bm, other=0) // PAGE
        first_miss = tl.minimum(full_bb, full_b)
        for j0 in range(0, j_end, BLOCK_C):
            cj = j0 + tl.arange(0, BLOCK_C)
            cm = cj < j_end
            row_b = tl.load(bt_ptr + b * MB + cj, mask=cm, other=-1)
            tile = tl.load(bt_ptr + bb[:, None] * MB + cj[None, :],
                           mask=bm[:, None] & cm[None, :], other=-1)
            diff = (tile != row_b[None, :]) & cm[None, :]
            first_miss = tl.minimum(first_miss, tl.min(tl.where(diff, cj[None, :], 2147483647), 1))
        alive = (first_miss[:, None] > offs_j[None, :]) & bm[:, None]
        cnt += tl.sum(alive.to(tl.int32), 0)
        rank += tl.sum((alive & (bb[:, None] < b)).to(tl.int32), 0)
        rep = tl.minimum(rep, tl.min(tl.where(alive, bb[:, None], B), 0))
    tl.store(cnt_ptr + b * MB + offs_j, cnt, mask=jm)
    tl.store(rank_ptr + b * MB + offs_j, rank, mask=jm)
    tl.store(rep_ptr + b * MB + offs_j, rep, mask=jm)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _next_after(flag_next, jn, carry, MB):
    """Within a tile laid out right to left (columns ``j = jn - 1`` descending), the smallest
    ``j' > j`` whose flag is set (``flag_next`` = the flag of column ``jn``), else ``carry``
    (the answer right of the tile); returns (per-column answer, carry for the next tile)."""
    pos = tl.where(flag_next & (jn < MB), jn, MB)
    nxt = tl.minimum(tl.associative_scan(pos, 0, _min_combine), carry)
    return nxt, tl.minimum(carry, tl.min(pos, 0))


@triton.jit
def _plan_rows_kernel(cnt_ptr, rank_ptr, bt_ptr, sl_ptr, run_end_ptr, flags_ptr, slot_ptr,
                      tpre_ptr, end_ptr, n_sh_slots_ptr, pv_bt_ptr, pv_len_ptr, row_tiles_ptr,
                      row_ids_ptr, MB, C, G, min_tokens, max_levels,
                      PAGE: tl.constexpr, BLOCK_J: tl.constexpr):
    """Request b's row of the plan, in three passes over column tiles (see the module doc).

    The passes walk only the tiles that hold b's ``ncols`` columns, not the table's ``MB``:
    past them every class size is 0 (the class pass writes it), so nothing is shared, started
    or private there and the carries are final (the sampler's tables are ``max_model_len /
    page`` wide whatever the step's lengths). Only the private row's tail is zeroed to ``MB``.

    Scratch it writes for ``_plan_items_kernel``: ``flags`` (1 = shared, 2 = item start),
    ``slot``, ``tpre`` (items led by this row's cells before column j) and ``end`` (item end
    column), each ``[B, MB]`` int32, in b's walked tiles only (the items kernel reads no
    column past ``ncols``); outputs ``n_sh_slots``, ``pv_bt``, ``pv_len``, and per row the
    items it leads (``row_tiles``) and the min / max block id it reads (``row_ids``)."""
    b = tl.program_id(0)
    row = b.to(tl.int64) * MB
    sl = tl.load(sl_ptr + b)
    ncols = (sl + PAGE - 1) // PAGE
    offs = tl.arange(0, BLOCK_J)
    n_tiles = tl.cdiv(tl.minimum(ncols, MB), BLOCK_J)  # the tiles holding b's columns
    # pass 1, right to left: run_end = next column whose class size changes (else MB); a
    # change at the first column past the walked tiles is seen from the last one (j + 1)
    carry = MB
    for t in range(n_tiles):
        j = (n_tiles - 1 - t) * BLOCK_J + (BLOCK_J - 1 - offs)
        jn = j + 1
        here = tl.load(cnt_ptr + row + j, mask=j < MB, other=0)
        after = tl.load(cnt_ptr + row + jn, mask=jn < MB, other=0)
        nxt, carry = _next_after(after != here, jn, carry, MB)
        tl.store(run_end_ptr + row + j, nxt, mask=j < MB)
    tl.debug_barrier()
    # pass 2, left to right: nodes, levels, shared columns, item starts, slots, private row
    c_start = -1
    c_level = 0
    c_slot = 0
    c_tiles = 0
    c_priv = 0
    c_shared = 0
    id_lo = 2147483647
    id_hi = -2147483647
    for t in range(n_tiles):
        j = t * BLOCK_J + offs
        inb = j < MB
        cnt = tl.load(cnt_ptr + row + j, mask=inb, other=0)
        prev = tl.load(cnt_ptr + row + j - 1, mask=inb & (j > 0), other=-1)
        change = inb & (cnt != prev)
        run_start = tl.maximum(tl.associative_scan(tl.where(change, j, -1), 0, _max_combine),
                               c_start)
        run_end = tl.load(run_end_ptr + row + j, mask=inb, other=MB)
        worthy = inb & (cnt >= 2) & ((run_end - run_start) * PAGE >= min_tokens)
        inc = (worthy & change).to(tl.int32)
        level = c_level + tl.cumsum(inc, 0) - 1
        shared = worthy & (level < max_levels)
        # a column inside a node run has the run's shared flag, so "~prev_shared" only holds
        # where the class size changes: start = shared & (chunk boundary | change)
        start = shared & (((j % C) == 0) | change)
        st = start.to(tl.int32)
        slot = c_slot + tl.cumsum(st, 0) - 1
        rank = tl.load(rank_ptr + row + j, mask=inb, other=1)
        ntile = tl.where(start & (rank == 0), (cnt + G - 1) // G, 0)
        tpre = c_tiles + tl.cumsum(ntile, 0) - ntile
        valid = inb & (j < ncols)
        priv = valid & ~shared
        pv = priv.to(tl.int32)
        ppos = c_priv + tl.cumsum(pv, 0) - 1
        bt = tl.load(bt_ptr + row + j, mask=inb, other=0)
        tl.store(pv_bt_ptr + row + ppos, bt, mask=priv)
        tl.store(flags_ptr + row + j, shared.to(tl.int32) + 2 * st, mask=inb)
        tl.store(slot_ptr + row + j, slot, mask=inb)
        tl.store(tpre_ptr + row + j, tpre, mask=inb)
        ids = tl.where(valid, bt, 0)
        id_lo = tl.minimum(id_lo, tl.min(tl.where(inb, ids, 2147483647), 0))
        id_hi = tl.maximum(id_hi, tl.max(tl.where(inb, ids, -2147483647), 0))
        c_start = tl.max(run_start, 0)
        c_level += tl.sum(inc, 0)
        c_slot += tl.sum(st, 0)
        c_tiles += tl.sum(ntile, 0)
        c_priv += tl.sum(pv, 0)
        c_shared += tl.sum(shared.to(tl.int32), 0)
    if n_tiles * BLOCK_J < MB:  # unwalked columns are padding: their id counts as 0
        id_lo = tl.minimum(id_lo, 0)
        id_hi = tl.maximum(id_hi, 0)
    tl.store(n_sh_slots_ptr + b, c_slot)
    tl.store(pv_len_ptr + b, sl - PAGE * c_shared)
    tl.store(row_tiles_ptr + b, c_tiles)
    tl.store(row_ids_ptr + 2 * b, id_lo)
    tl.store(row_ids_ptr + 2 * b + 1, id_hi)
    tl.debug_barrier()
    # pass 3, right to left: item end = next start or unshared column (capped at ncols: a
    # column past them reads as unshared, flag 0)
    carry = MB
    for t in range(n_tiles):
        j = (n_tiles - 1 - t) * BLOCK_J + (BLOCK_J - 1 - offs)
        jn = j + 1
        f = tl.load(flags_ptr + row + jn, mask=jn < ncols, other=0)
        nxt, carry = _next_after(((f & 2) != 0) | ((f & 1) == 0), jn, carry, MB)
        tl.store(end_ptr + row + j, tl.minimum(nxt, ncols), mask=j < MB)
    # the private row's unused tail, to the table's width, is zeroed (stores only)
    for t in range(c_priv // BLOCK_J, tl.cdiv(MB, BLOCK_J)):
        jz = t * BLOCK_J + offs
        tl.store(pv_bt_ptr + row + jz, tl.zeros([BLOCK_J], tl.int32), mask=(jz < MB) & (jz >= c_priv))


@triton.jit
def _plan_offsets_kernel(row_tiles_ptr, row_ids_ptr, row_off_ptr, n_shared_ptr, id_range_ptr,
                         B, BLOCK_B: tl.constexpr):
    """One program: ``row_off`` = exclusive prefix sum of ``row_tiles`` (items are numbered row
    by row, column by column), ``n_shared`` = their total, ``id_range`` = (min, max) of the
    rows' block-id ranges."""
    offs = tl.arange(0, BLOCK_B)
    carry = 0
    lo = 2147483647
    hi = -2147483647
    for b0 in range(0, B, BLOCK_B):
        bb = b0 + offs
        m = bb < B
        tiles = tl.load(row_tiles_ptr + bb, mask=m, other=0)
        tl.store(row_off_ptr + bb, carry + tl.cumsum(tiles, 0) - tiles, mask=m)
        carry += tl.sum(tiles, 0)
        lo = tl.minimum(lo, tl.min(tl.load(row_ids_ptr + 2 * bb, mask=m, other=2147483647), 0))
        hi = tl.maximum(hi, tl.max(tl.load(row_ids_ptr + 2 * bb + 1, mask=m, other=-2147483647), 0))
    tl.store(n_shared_ptr, carry)
    tl.store(id_range_ptr, lo)
    tl.store(id_range_ptr + 1, hi)


@triton.jit
def _plan_items_kernel(cnt_ptr, rank_ptr, rep_ptr, flags_ptr, slot_ptr, tpre_ptr, end_ptr,
                       row_off_ptr, sh_mem_ptr, sh_fields_ptr, sl_ptr, MB, G, cap,
                       PAGE: tl.constexpr, BLOCK_J: tl.constexpr):
    """Program (request b, column tile): a start cell (b, j) belongs to item
    ``row_off[rep] + tpre[rep, j] + rank // G`` (numbered at its class's smallest member) and
    writes b into its member slot ``rank % G``; the tile's first member (``rank % G == 0``)
    writes the item's fields (row, c0, c1, slot, members) into ``sh_fields [5, cap + 1]``.
    Columns past b's ``ncols`` hold no start and are not read (the rows kernel left them)."""
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    row = b.to(tl.int64) * MB
    inb = (j < MB) & (j < (tl.load(sl_ptr + b) + PAGE - 1) // PAGE)
    start = inb & ((tl.load(flags_ptr + row + j, mask=inb, other=0) & 2) != 0)
    cnt = tl.load(cnt_ptr + row + j, mask=start, other=0)
    rank = tl.load(rank_ptr + row + j, mask=start, other=0)
    rep = tl.load(rep_ptr + row + j, mask=start, other=0)
    lead_row = rep.to(tl.int64) * MB
    item = (tl.load(row_off_ptr + rep, mask=start, other=0)
            + tl.load(tpre_ptr + lead_row + j, mask=start, other=0) + rank // G)
    tl.store(sh_mem_ptr + item.to(tl.int64) * G + rank % G, tl.zeros_like(rank) + b, mask=start)
    first = start & ((rank % G) == 0)
    fields = sh_fields_ptr + item.to(tl.int64)
    tl.store(fields, tl.zeros_like(rank) + b, mask=first)
    tl.store(fields + (cap + 1), j, mask=first)
    tl.store(fields + 2 * (cap + 1), tl.load(end_ptr + row + j, mask=first, other=0), mask=first)
    tl.store(fields + 3 * (cap + 1), tl.load(slot_ptr + row + j, mask=first, other=0), mask=first)
    tl.store(fields + 4 * (cap + 1), tl.minimum(cnt - (rank // G) * G, G), mask=first)

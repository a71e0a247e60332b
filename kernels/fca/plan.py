"""Forest planning for FCA decode: find shared KV prefixes on the device, once per step.

Requests that share a prefix share physical block ids in their block-table rows (that is how
the sampler's prefix cache lays them out; a partially filled last block is never shared).
``plan_forest`` turns ``block_tables`` / ``seq_lens`` into a :class:`ForestPlan`: fixed-capacity
work lists that ``fca_decode`` runs in every layer of the step::

    plan = plan_forest(block_tables, seq_lens, block_size)   # once per decode step
    for layer in layers:
        out = fca_decode(q, k_cache[layer], v_cache[layer], plan)

How the forest is found (no host synchronisation, static shapes, CUDA-graph capturable):

* column ``j`` of request ``b`` is a *cell*; two requests are in the same class at column ``j``
  when their rows hold the same ids in columns ``0..j`` and those blocks are full. Classes only
  split as ``j`` grows, so per cell we keep ``cnt`` (class size), ``rep`` (smallest member) and
  ``rank`` (members with a smaller index): a node of the forest is a maximal run of columns with
  the same ``cnt`` — any depth (system prompt -> prompt -> sample) falls out of this;
* cost model: a node is *shared* when it has ``>= 2`` members, spans ``>= min_shared_tokens``
  and lies at most ``max_levels`` shared nodes deep; everything else goes to the plain path;
* shared columns are cut into *items* (node starts and ``chunk_tokens`` boundaries, for split-K
  parallelism); a shared item reads its blocks once for a tile of up to ``max_group``
  members and writes one partial (o, lse) per member into the member's next *slot*;
* the remaining (private) blocks of each request are compacted into a virtual block-table row
  that the plain paged kernel reads (split-K at decode time); the merge combines a request's
  slots exactly by log-sum-exp.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class ForestPlan:
    """Work lists for one decode step (all tensors on the block tables' device, int32).

    Shared items (capacity ``cap``; the first ``n_shared[0]`` are live): ``sh_row`` (block-table
    row to read ids from), ``sh_c0`` / ``sh_c1`` (column range), ``sh_slot`` (partial slot of
    every member), ``sh_nmem`` and ``sh_mem [cap + 1, max_group]`` (member request ids).
    ``n_sh_slots [B]`` shared partials per request (``<= max_shared_slots``). The private part
    of request b is a virtual block-table row ``pv_bt [B, max_blocks]`` holding its unshared
    blocks in order, ``pv_len [B]`` tokens long (0 when everything is shared).
    ``counters [2]`` is scratch for the kernels' dynamic scheduler (reset by the merge);
    ``block_id_range [2]`` the smallest and largest id any request reads (bounds check).
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    max_group: int
    max_shared_slots: int
    cap: int
    n_sh_slots: torch.Tensor
    n_shared: torch.Tensor
    sh_row: torch.Tensor
    sh_c0: torch.Tensor
    sh_c1: torch.Tensor
    sh_slot: torch.Tensor
    sh_nmem: torch.Tensor
    sh_mem: torch.Tensor
    pv_bt: torch.Tensor
    pv_len: torch.Tensor
    counters: torch.Tensor
    block_id_range: torch.Tensor
    checked_num_blocks: int | None = None

    @property
    def batch_size(self) -> int:
        return self.block_tables.shape[0]

    def work_tensors(self) -> tuple[torch.Tensor, ...]:
        """The read-only work lists in :data:`WORK_FIELDS` order (``counters`` apart: the
        kernels write it). With :meth:`from_tensors` this carries a plan through code that
        takes tensors only (a ``torch.library`` custom op)."""
        return tuple(getattr(self, name) for name in WORK_FIELDS)

    @classmethod
    def from_tensors(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                     max_shared_slots: int, work: tuple[torch.Tensor, ...] | list[torch.Tensor],
                     counters: torch.Tensor) -> ForestPlan:
        """The plan whose ``work_tensors()`` are ``work`` (``max_group`` and ``cap`` are read
        from ``sh_mem``'s shape)."""
        fields = dict(zip(WORK_FIELDS, work, strict=True))
        sh_mem = fields["sh_mem"]
        return cls(block_tables=block_tables, seq_lens=seq_lens, block_size=block_size,
                   max_group=sh_mem.shape[1], max_shared_slots=max_shared_slots,
                   cap=sh_mem.shape[0] - 1, counters=counters, checked_num_blocks=None, **fields)

    def stats(self) -> dict[str, int]:
        """Host-side summary (synchronises; for logs and tests, not the hot path)."""
        nsh = int(self.n_shared.item())
        return {
            "shared_items": nsh,
            "shared_member_rows": int(self.sh_nmem[:nsh].sum().item()),
            "max_shared_slots_used": int(self.n_sh_slots.max().item()),
            "private_tokens": int(self.pv_len.sum().item()),
        }


WORK_FIELDS = ("n_sh_slots", "n_shared", "sh_row", "sh_c0", "sh_c1", "sh_slot", "sh_nmem",
               "sh_mem", "pv_bt", "pv_len", "block_id_range")


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 validate: bool | None = None) -> None:
    """ValueError on bad block tables / lengths. Value checks cost one host sync; they are
    skipped when ``validate`` is False, or when None and a CUDA graph is being captured."""
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        raise ValueError("block_tables must be a 2-D tensor [B, max_blocks]")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1:
        raise ValueError("seq_lens must be a 1-D tensor [B]")
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be int32 (or int64), got {block_tables.dtype}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32 (or int64), got {seq_lens.dtype}")
    if seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} rows, block_tables "
                         f"{block_tables.shape[0]}")
    if block_tables.shape[0] == 0 or block_tables.shape[1] == 0:
        raise ValueError("block_tables must be non-empty")
    if seq_lens.device != block_tables.device:
        raise ValueError(f"seq_lens on {seq_lens.device}, block_tables on {block_tables.device}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if validate is False or (validate is None and _is_capturing(block_tables.device)):
        return
    cap = block_tables.shape[1] * block_size
    if bool(((seq_lens <= 0) | (seq_lens > cap)).any()):
        bad = seq_lens[(seq_lens <= 0) | (seq_lens > cap)][0].item()
        raise ValueError(f"every seq_len must be in [1, max_blocks * block_size = {cap}]; "
                         f"got {bad} (seq_len 0 is not a decode request)")


def _classes_torch(bt: torch.Tensor, full: torch.Tensor):
    """cnt / rep / rank per cell by pairwise prefix comparison ([B, B, max_blocks] bool)."""
    B = bt.shape[0]
    eq = (bt[:, None, :] == bt[None, :, :]) & full[:, None, :] & full[None, :, :]
    eqp = eq.to(torch.uint8).cummin(dim=2).values.bool()  # prefix-equal through column j
    idx = torch.arange(B, device=bt.device)
    cnt = eqp.sum(dim=1, dtype=torch.int32)
    rank = (eqp & (idx[None, :, None] < idx[:, None, None])).sum(dim=1, dtype=torch.int32)
    rep = torch.where(eqp, idx[None, :, None].to(torch.int32), B).amin(dim=1).to(torch.int32)
    return cnt, rep, rank


def classes_triton(bt: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """Planner pass on the GPU: (cnt, rep, rank) per cell, each ``[B, max_blocks]`` int32."""
    from .plan_kernel import _fca_classes_kernel

    B, MB = bt.shape
    cnt = torch.empty_like(bt)
    rep = torch.empty_like(bt)
    rank = torch.empty_like(bt)
    block_j = 128
    _fca_classes_kernel[(B, -(-MB // block_j))](
        bt, seq_lens, cnt, rep, rank, B, MB, PAGE=block_size, BLOCK_B=64, BLOCK_J=block_j,
        BLOCK_C=64, num_warps=4)
    return cnt, rep, rank


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def _next_true(mask: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """For each column j: the smallest j' > j with mask[:, j'], else ``limit`` (per row)."""
    _B, MB = mask.shape
    j = torch.arange(MB, device=mask.device, dtype=torch.int32)
    pos = torch.where(mask, j[None, :], MB)
    shifted = torch.cat([pos[:, 1:], torch.full_like(pos[:, :1], MB)], dim=1)
    nxt = shifted.flip(1).cummin(dim=1).values.flip(1)
    return torch.minimum(nxt, limit[:, None].to(torch.int32))


def plan_forest(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    *,
    min_shared_tokens: int = 64,
    max_levels: int = 4,
    chunk_tokens: int = 2048,
    max_group: int = 16,
    validate: bool | None = None,
    backend: str = "auto",
) -> ForestPlan:
    """Discover the forest of shared prefixes and build FCA's work lists, on the tables' device.

    Args:
        block_tables: ``[B, max_blocks]`` int32 physical block ids (entries past a request's
            last block are ignored; -1 is fine).
        seq_lens: ``[B]`` int32 tokens in the KV cache per request (the new token included).
        block_size: tokens per KV block (page).
        min_shared_tokens: cost model: shorter shared nodes go to the plain path.
        max_levels: cost model: at most this many shared nodes on a request's path.
        chunk_tokens: split-K granularity of shared nodes (items never cross a multiple).
        max_group: members per shared tile (larger groups get several tiles).
        validate: value checks with one host sync (None: unless capturing a CUDA graph).
        backend: ``"auto"`` — ``"triton"`` on CUDA, ``"torch"`` elsewhere. ``"triton"`` — the
            whole plan in four Triton launches (``plan_kernel.py``; CUDA, or the CPU under
            ``TRITON_INTERPRET=1``). ``"torch"`` — ~50 torch ops (the oracle the Triton planner
            is tested against, field by field; also on CUDA).

    Returns:
        A :class:`ForestPlan`, valid for every layer of this step.
    """
    check_tables(block_tables, seq_lens, block_size, validate)
    if max_levels < 1 or max_group < 1 or chunk_tokens < 1 or min_shared_tokens < 0:
        raise ValueError("max_levels, max_group, chunk_tokens must be >= 1")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and not block_tables.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("plan_forest(backend='triton') needs CUDA tensors (or TRITON_INTERPRET=1 "
                         "on the CPU); use backend='auto' or 'torch'")
    dev = block_tables.device
    bt = block_tables.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    B, MB = bt.shape
    C = max(1, chunk_tokens // block_size)
    max_slots = -(-MB // C) + max_levels
    cap = B * min(MB, max_slots)
    i32 = torch.int32

    if backend == "triton" or (backend == "auto" and bt.is_cuda):
        return _plan_triton(bt, sl, block_size, C, max_group, min_shared_tokens, max_levels,
                            cap, max_slots)
    j = torch.arange(MB, device=dev, dtype=i32)[None, :]
    ncols = (sl + block_size - 1) // block_size
    valid = j < ncols[:, None]
    full = (j + 1) * block_size <= sl[:, None]
    cnt, rep, rank = _classes_torch(bt, full)
    b_idx = torch.arange(B, device=dev, dtype=i32)[:, None].expand(B, MB)
    rep = torch.where(cnt > 0, rep, b_idx)

    # Nodes: maximal runs of equal class size (classes only split, so equal size = same set).
    cand = cnt >= 2
    prev_cnt = torch.cat([torch.full_like(cnt[:, :1], -1), cnt[:, :-1]], dim=1)
    change = cnt != prev_cnt
    run_start = torch.where(change, j, -1).cummax(dim=1).values
    run_end = _next_true(change, torch.full_like(ncols, MB))
    worthy = cand & ((run_end - run_start) * block_size >= min_shared_tokens)
    level = torch.cumsum((worthy & change).to(i32), dim=1) - 1
    shared = worthy & (level < max_levels)

    # Shared items start at node starts and chunk boundaries; one partial slot per start.
    prev_shared = torch.cat([torch.zeros_like(shared[:, :1]), shared[:, :-1]], dim=1)
    start = shared & ((j % C == 0) | ~prev_shared | change)
    slot = (torch.cumsum(start.to(i32), dim=1) - 1).to(i32)
    n_sh_slots = start.sum(dim=1, dtype=i32)
    end = _next_true(start | ~shared, ncols)

    G = max_group
    jj = j.expand(B, MB)
    # One item per (class start cell, tile of G members), numbered by the class's first
    # member's cell; every member cell scatters itself into its tile.
    lead = start & (rank == 0)
    ntiles = torch.where(lead, (cnt + G - 1) // G, 0)
    base = torch.cumsum(_flat(ntiles), 0) - _flat(ntiles)
    n_shared = _flat(ntiles).sum(dtype=i32).reshape(1)
    item = torch.where(_flat(start), base[_flat(rep).long() * MB + _flat(jj).long()]
                       + _flat(rank // G).long(), cap)
    sh_mem = torch.full(((cap + 1) * G,), -1, device=dev, dtype=i32)
    sh_mem[item * G + _flat(torch.where(start, rank % G, 0)).long()] = _flat(b_idx).to(i32)
    sh_mem = sh_mem.view(cap + 1, G)
    tl_item = torch.where(_flat(start & (rank % G == 0)), item, cap)
    sh_fields = torch.zeros(5, cap + 1, device=dev, dtype=i32)
    vals = torch.stack([_flat(b_idx), _flat(jj), _flat(end), _flat(slot),
                        _flat(torch.clamp(cnt - (rank // G) * G, max=G))]).to(i32)
    sh_fields[:, tl_item] = vals
    # Private blocks: every other valid column, compacted into a virtual block-table row
    # (the partial last block is never shared, so it stays last).
    priv = valid & ~shared
    pos = torch.where(priv, torch.cumsum(priv.to(i32), dim=1) - 1, MB).long()
    pv_bt = torch.zeros(B, MB + 1, device=dev, dtype=i32).scatter_(1, pos, bt)[:, :MB]
    pv_len = (sl - block_size * shared.sum(dim=1, dtype=i32)).to(i32)

    id_range = torch.stack([torch.where(valid, bt, 0).amin(), torch.where(valid, bt, 0).amax()])
    return _assemble(bt, sl, block_size, G, max_slots, cap, n_sh_slots, n_shared, sh_fields,
                     sh_mem, pv_bt, pv_len, id_range)


def _assemble(bt, sl, block_size, G, max_slots, cap, n_sh_slots, n_shared, sh_fields, sh_mem,
              pv_bt, pv_len, id_range) -> ForestPlan:
    """The plan from its work lists (``sh_fields [5, cap + 1]``: row, c0, c1, slot, members)."""
    return ForestPlan(
        block_tables=bt, seq_lens=sl, block_size=block_size, max_group=G,
        max_shared_slots=max_slots, cap=cap, n_sh_slots=n_sh_slots,
        n_shared=n_shared, sh_row=sh_fields[0], sh_c0=sh_fields[1], sh_c1=sh_fields[2],
        sh_slot=sh_fields[3], sh_nmem=sh_fields[4], sh_mem=sh_mem,
        pv_bt=pv_bt, pv_len=pv_len, counters=torch.zeros(2, device=bt.device, dtype=torch.int32),
        block_id_range=id_range,
    )


_PLAN_BLOCK_J = 128


def _plan_triton(bt: torch.Tensor, sl: torch.Tensor, block_size: int, C: int, G: int,
                 min_tokens: int, max_levels: int, cap: int, max_slots: int) -> ForestPlan:
    """``plan_forest`` in four Triton launches (``plan_kernel.py``); the same work lists as the
    torch ops (entries past ``n_shared`` and the dump slot ``cap`` are scratch either way)."""
    from .plan_kernel import _plan_items_kernel, _plan_offsets_kernel, _plan_rows_kernel

    B, MB = bt.shape
    dev, i32 = bt.device, torch.int32
    cnt, rep, rank = classes_triton(bt, sl, block_size)
    scratch = torch.empty(5, B, MB, device=dev, dtype=i32)  # run_end, flags, slot, tpre, end
    run_end, flags, slot, tpre, end = scratch.unbind(0)
    n_sh_slots = torch.empty(B, device=dev, dtype=i32)
    pv_bt = torch.empty(B, MB, device=dev, dtype=i32)
    pv_len = torch.empty(B, device=dev, dtype=i32)
    row_tiles, row_off = torch.empty(2, B, device=dev, dtype=i32).unbind(0)  # items led, first item
    row_ids = torch.empty(B, 2, device=dev, dtype=i32)  # smallest / largest block id read
    _plan_rows_kernel[(B,)](cnt, rank, bt, sl, run_end, flags, slot, tpre, end, n_sh_slots,
                            pv_bt, pv_len, row_tiles, row_ids, MB, C, G, min_tokens, max_levels,
                            PAGE=block_size, BLOCK_J=_PLAN_BLOCK_J, num_warps=4)
    n_shared = torch.empty(1, device=dev, dtype=i32)
    id_range = torch.empty(2, device=dev, dtype=i32)
    _plan_offsets_kernel[(1,)](row_tiles, row_ids, row_off, n_shared, id_range, B,
                               BLOCK_B=128, num_warps=4)
    sh_mem = torch.full((cap + 1, G), -1, device=dev, dtype=i32)
    sh_fields = torch.zeros(5, cap + 1, device=dev, dtype=i32)
    _plan_items_kernel[(B, -(-MB // _PLAN_BLOCK_J))](
        cnt, rank, rep, flags, slot, tpre, end, row_off, sh_mem, sh_fields, sl, MB, G, cap,
        PAGE=block_size, BLOCK_J=_PLAN_BLOCK_J, num_warps=4)
    return _assemble(bt, sl, block_size, G, max_slots, cap, n_sh_slots, n_shared, sh_fields,
                     sh_mem, pv_bt, pv_len, id_range)

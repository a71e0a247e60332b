"""The attention mask of packed ZoRRo rows: the visibility rule, per-layer windows, block masks.

The visibility rule (see ``tree.py``): key ``j`` is visible from query ``i`` iff
``tin[j] <= tin[i] and tout[i] <= tout[j] and j <= i`` — ``j`` lies on ``i``'s own path through
the prefix forest. A sliding-window layer (``polynya.model_features``) also needs
``pos[i] - pos[j] < W`` with ``pos`` the tokens' positions in their own sequence (the RoPE
positions), so a response token sees the last ``W`` positions of its own prompt + response,
exactly as in its naive row.

``ZorroMask`` carries the forest and hands each layer the form its path needs, built once per
window and cached for the batch: a dense ``[R, 1, L, L]`` bool (CPU), a FlexAttention
``BlockMask`` (GPU), the split plan (GPU, full-attention layers; ``polynya.zorro.attention``),
or, for a forest of leaves only (the packed naive layout, or a batch that shares nothing), the
segment boundaries of varlen attention (``segments`` / ``bounds`` / ``varlen_plan``).
It is a ``BlockMask`` only so that transformers passes it to the attention untouched, as it does
every 4-D mask, whatever mask function the model would build for the layer.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from ..kernels.zorro import (MAX_INNER, plan_split, segment_bounds, unsupported_reason,
                             varlen_unsupported_reason)
from ..kernels.zorro.plan import LEAF_MULTIPLE
from ..model_features import AttentionFeatures

FLEX_BLOCK = 128
SPLIT_MIN_SHARE = 1.5  # auto: split when shared-prefix work >= this x the responses' own work
CUDNN_OVER_FA2 = 1.3   # auto, segments only: cuDNN's padded batch when its work <= this x varlen's
LEAF_BATCH_MIN_LEN = 2048  # ... and its segments are at least this long (padded)


class ZorroMask(BlockMask):
    """The ``attention_mask`` of packed ZoRRo rows (module docstring).

    Args:
        tin, tout: ``[R, L]`` int32 preorder intervals of each token's node.
        nodes: the packed rows' node table (split attention plans from it) or None.
        attention: ``"auto"`` / ``"split"`` / ``"flex"`` / ``"varlen"`` (GPU path choice).
        position_ids: ``[R, L]`` positions (needed by windowed layers).
        features: the model's ``AttentionFeatures`` (per-layer windows; None = all full).
    """

    def __init__(self, tin: torch.Tensor, tout: torch.Tensor, nodes, attention: str,
                 position_ids: torch.Tensor | None = None, features: AttentionFeatures | None = None):
        self.tin, self.tout, self.nodes, self.attention = tin, tout, nodes, attention
        self.position_ids, self.features = position_ids, features
        self.segments = nodes is not None and bool((nodes[:, 2] == nodes[:, 1]).all())
        if attention == "varlen" and not self.segments:
            raise ValueError("zorro_attention='varlen' needs rows of separate samples (nothing "
                             "shared: zorro=False, or a batch without shared prompts); use 'auto'")
        pays = _leaf_batch_pays if self.segments else _split_pays
        self._pays = nodes is not None and (attention == "split" or
                                            (attention == "auto" and pays(nodes)))
        self._plan = None
        self._bounds: np.ndarray | None = None
        self._cu = None  # (cu_seqlens on the device, longest segment)
        self._flex: dict = {}   # window -> BlockMask
        self._dense: dict = {}  # window -> [R, 1, L, L] bool
        self._why: dict = {}    # unsupported_reason per (device, dtype, heads, head dim)

    @property
    def shape(self):
        rows, length = self.tin.shape
        return (rows, 1, length, length)

    def _positions(self, window: int | None) -> torch.Tensor | None:
        if window is not None and self.position_ids is None:
            raise ValueError("a sliding-window layer needs the packed rows' position_ids")
        return self.position_ids if window is not None else None

    def dense(self, window: int | None = None) -> torch.Tensor:
        """``[R, 1, L, L]`` bool mask of the rule (with the window, when given)."""
        if window not in self._dense:
            self._dense[window] = dense_mask(self.tin, self.tout, self._positions(window), window)
        return self._dense[window]

    def split_plan(self, query: torch.Tensor, key: torch.Tensor):
        """The split plan when this batch takes split attention with these inputs, else None;
        ``ValueError`` when ``"split"`` was asked for and the kernels cannot take the inputs.
        (Windowed and soft-capped layers never ask: they run FlexAttention.)"""
        if not self._pays:
            return None
        sig = (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1])
        if sig not in self._why:
            self._why[sig] = unsupported_reason(query, key)
        if self._why[sig] is not None:
            if self.attention == "split":
                raise ValueError(f"zorro_attention='split' cannot run here: {self._why[sig]}; "
                                 "use 'auto' or 'flex'")
            return None
        if self._plan is None:
            rows, length = self.tin.shape
            self._plan = plan_split(self.nodes, rows * length, self.tin.device)
        return self._plan

    def bounds(self) -> np.ndarray:
        """Host ``[S + 1]`` flat boundaries of the segments (``segments`` only; padding between
        samples forms segments of its own, none crosses a row)."""
        if self._bounds is None:
            rows, length = self.tin.shape
            self._bounds = segment_bounds(self.nodes, rows * length, length)
        return self._bounds

    def varlen_plan(self, query: torch.Tensor, key: torch.Tensor):
        """``(cu_seqlens, max_len)`` when this batch takes varlen attention with these inputs,
        else None; ``ValueError`` when ``"varlen"`` was asked for and the kernel cannot take
        them. (Windowed and soft-capped layers never ask: they run FlexAttention.)"""
        if not self.segments or self.attention not in ("auto", "varlen"):
            return None
        sig = ("varlen", query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1])
        if sig not in self._why:
            self._why[sig] = varlen_unsupported_reason(query, key)
        if self._why[sig] is not None:
            if self.attention == "varlen":
                raise ValueError(f"zorro_attention='varlen' cannot run here: {self._why[sig]}; "
                                 "use 'auto' or 'flex'")
            return None
        if self._cu is None:
            b = self.bounds()
            self._cu = (torch.from_numpy(b).to(self.tin.device, torch.int32), int(np.diff(b).max()))
        return self._cu

    def flex_mask(self, window: int | None = None) -> BlockMask:
        if window not in self._flex:
            self._flex[window] = interval_block_mask(self.tin, self.tout, FLEX_BLOCK,
                                                     self._positions(window), window)
        return self._flex[window]

    def __repr__(self) -> str:
        path = ("split" if self._pays else
                "varlen" if self.segments and self.attention in ("auto", "varlen") else "flex")
        return f"ZorroMask(shape={self.shape}, path={path}, attention={self.attention!r})"


def _split_pays(nodes) -> bool:
    """Whether ``auto`` should take the split path for this forest (``[N, 3]`` node table).

    Split attention pays per call (leaf gathers, the combine) and wins by reading shared keys
    with cuDNN; measured on the H200 (benchmarks/bench_zorro.py, 4 groups): ahead of
    FlexAttention at P4096/R512 (shared/own work 33), P2048/R512 (12), P1024/R1024 (2.2),
    behind at P256/R512 (1.06). So: at most ``MAX_INNER`` shared nodes and a shared-key work
    (query x key pairs of the inner calls) of at least ``SPLIT_MIN_SHARE`` x the leaves' causal
    pairs.
    """
    start, end, stop = (nodes[:, i].astype(float) for i in range(3))
    inner = stop > end
    if not inner.any() or inner.sum() > MAX_INNER:
        return False
    shared = ((stop - start) * (end - start))[inner].sum()
    own = ((end - start) ** 2 / 2)[~inner].sum()
    return bool(shared >= SPLIT_MIN_SHARE * own)


def _leaf_batch_pays(nodes) -> bool:
    """Whether ``auto`` should run a forest of leaves only (packed samples) as split attention's
    one cuDNN call over the padded batch of segments rather than as FlashAttention-2 varlen.

    Kernel alone, cuDNN's batch is faster (H200, ``probe_cudnn_split.py``: 8 x 512 causal,
    0.225 ms fwd + bwd vs FlashAttention-2 varlen 0.326 ms), but in a whole step it also pays
    the gathers into the padded batch, the copy out and their launches: measured per step
    (``benchmarks/profile_zorro_step.py --scan``, fwd + bwd of Qwen3-0.6B) varlen was as fast or
    faster at every segment length up to 1,280 (1.1-1.47x at 256-640, equal at 1,280). So cuDNN
    only for long segments (``LEAF_BATCH_MIN_LEN``, where attention is a large share of a
    layer's work) of near-equal lengths: ``leaves x padded_len^2 <= CUDNN_OVER_FA2 x sum(len^2)``.
    """
    lens = (nodes[:, 1] - nodes[:, 0]).astype(float)
    if not lens.size:
        return False
    padded = -(-lens.max() // LEAF_MULTIPLE) * LEAF_MULTIPLE
    return bool(padded >= LEAF_BATCH_MIN_LEN and lens.size * padded ** 2 <= CUDNN_OVER_FA2 * (lens ** 2).sum())


def _visible(q_tin, q_tout, q_idx, k_tin, k_tout, k_idx, q_pos=None, k_pos=None, window=None):
    """The visibility rule on broadcast operands (one definition for mask_mod, blocks, dense)."""
    vis = (k_tin <= q_tin) & (q_tout <= k_tout) & (k_idx <= q_idx)
    return vis & (q_pos - k_pos < window) if window is not None else vis


def dense_mask(tin: torch.Tensor, tout: torch.Tensor, pos: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
    """``[R, 1, L, L]`` bool: the rule for every (query, key) pair of each row."""
    idx = torch.arange(tin.shape[1], device=tin.device)
    qp, kp = (pos[:, :, None], pos[:, None, :]) if window is not None else (None, None)
    return _visible(tin[:, :, None], tout[:, :, None], idx[:, None], tin[:, None, :],
                    tout[:, None, :], idx, qp, kp, window)[:, None]


def interval_block_mask(tin: torch.Tensor, tout: torch.Tensor, block: int = FLEX_BLOCK,
                        pos: torch.Tensor | None = None, window: int | None = None):
    """FlexAttention ``BlockMask`` of the visibility rule, built with plain tensor ops.

    ``create_block_mask`` would trace and compile the mask function for every new row length
    (tens of seconds each on a new shape: an RL run has a new one every step). Here every
    (query block, key block) pair is classified from the token rule directly, a few query
    blocks at a time (at most 2**26 token pairs in flight): *full* pairs run unmasked, *partial*
    pairs evaluate ``mask_mod`` per element, the rest are skipped. With a ``window``, ``pos``
    ``[R, L]`` holds the tokens' positions.
    """
    if tin.dim() != 2 or tin.shape != tout.shape:
        raise ValueError(f"tin and tout must both be [rows, length]; got {tuple(tin.shape)} "
                         f"and {tuple(tout.shape)}")
    if window is not None and (pos is None or pos.shape != tin.shape):
        raise ValueError("a windowed block mask needs positions of the rows' shape")
    rows, length = tin.shape
    if length % block:
        raise ValueError(f"packed rows must be padded to a multiple of {block} tokens for a "
                         f"block mask; got rows of {length}")
    nb = length // block
    dev = tin.device
    anyv = torch.empty(rows, nb, nb, dtype=torch.bool, device=dev)
    allv = torch.empty_like(anyv)
    k_idx = torch.arange(length, device=dev)
    k_tin, k_tout = tin[:, None, None, :], tout[:, None, None, :]
    k_pos = pos[:, None, None, :] if window is not None else None
    step = max(1, (1 << 26) // (rows * block * length))
    for s in range(0, nb, step):
        e = min(nb, s + step)
        span = slice(s * block, e * block)
        shape = (rows, e - s, block, 1)
        q_pos = pos[:, span].reshape(shape) if window is not None else None
        vis = _visible(tin[:, span].reshape(shape), tout[:, span].reshape(shape),
                       k_idx[span].view(1, e - s, block, 1), k_tin, k_tout, k_idx,
                       q_pos, k_pos, window)
        vis = vis.view(rows, e - s, block, nb, block)
        anyv[:, s:e] = vis.any(dim=4).any(dim=2)
        allv[:, s:e] = vis.all(dim=4).all(dim=2)

    def ordered(m: torch.Tensor):
        num = m.sum(-1, dtype=torch.int32)[:, None]
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
        return num.contiguous(), idx.contiguous()

    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return _visible(tin[b, q_idx], tout[b, q_idx], q_idx, tin[b, kv_idx], tout[b, kv_idx],
                            kv_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return _visible(tin[b, q_idx], tout[b, q_idx], q_idx, tin[b, kv_idx], tout[b, kv_idx],
                            kv_idx, pos[b, q_idx], pos[b, kv_idx], window)

    kv_num, kv_idx = ordered(anyv & ~allv)
    full_num, full_idx = ordered(allv)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(length, length))

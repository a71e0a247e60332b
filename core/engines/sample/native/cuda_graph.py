"""CUDA graphs for decode steps: one graph per batch-size bucket, captured on first use.

A decode step of an HF model launches hundreds of small kernels; replaying them as one graph
removes the per-launch CPU cost. Everything a step varies lives in static input buffers
(token ids, positions, cache slots, block tables, lengths) that are refilled before a replay;
the forest plan is built *inside* the graph (``plan_forest`` is capturable: no host sync,
fixed-capacity outputs), so a replay re-plans from the current block tables.

Graphs are keyed by ``(bucket, fca)``: a step whose sequences share no page runs the plain
paged graph. A batch of ``B`` sequences runs in the smallest bucket ``>= B``; the padding rows decode a
dummy token into a scratch page that the block manager never hands out. Block tables are
padded to the widest table the cache allows, so one graph serves every sequence length; a
step sends the device only the columns its rows use (the rest of the buffer is kept zero), not
the whole width (2560 columns for a model of 40,960 positions and 16-token pages).
All graphs share one memory pool: their replays never overlap and each output is read before
the next replay, so the intermediates of one bucket may reuse another's. The graphs outlive a
sleep/wake of the KV cache when it comes back at the same address (``kv_memory.py``).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from .readback import PINNED_TURNS


class GraphCaptureError(RuntimeError):
    """The model's decode step cannot be captured (it does host work per step); the caller
    decodes eagerly instead."""


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16, and ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8, *range(16, max_batch + 1, 16)) if b < max_batch]
    return sizes + [max_batch]


class DecodeGraphs:
    """Captures and replays ``forward(ids, pos, slots, block_tables, seq_lens) -> logits``.

    Args:
        forward: the decode step (eager, or compiled by ``compiled.py``: the compile runs on
            the warm-up calls) on device tensors ``[1, B]``, ``[1, B]``, ``[B]``,
            ``[B, width]`` int32, ``[B]`` int32 and the bool ``fca``; returns ``[B, V]`` logits.
        max_batch: largest batch. width: block-table columns. scratch_block: page for padding.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], max_batch: int, width: int,
                 block_size: int, scratch_block: int, device: torch.device) -> None:
        self.forward = forward
        self.sizes = buckets(max_batch)
        self.width, self.block_size, self.scratch = width, block_size, scratch_block
        self.device = device
        n = self.sizes[-1]
        self.ids = torch.zeros((1, n), dtype=torch.int64, device=device)
        self.pos = torch.zeros((1, n), dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.tables = torch.zeros((n, width), dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        # pinned staging taken in turn (``readback.PINNED_TURNS``): a step may be launched
        # before the previous steps' inputs have left (the engine launches decode steps early).
        # A step stages [b, 4 + used columns]: id, position, slot, length, then its tables.
        self.hosts = [torch.zeros(n * (4 + width), dtype=torch.int64).pin_memory()
                      for _ in range(PINNED_TURNS)]
        self._turn = 0
        self._zero_from = 0  # every row of ``self.tables`` is zero from this column on
        self.staged_bytes = 0  # host -> device bytes of the last step's inputs
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool for every graph (replays never overlap)
        self.captures, self.capture_s = 0, 0.0

    def bucket(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def _capture(self, b: int, fca: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        start = time.perf_counter()
        args = (self.ids[:, :b], self.pos[:, :b], self.slots[:b], self.tables[:b], self.lens[:b], fca)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile (Triton kernels, torch.compile), settle allocations
                self.forward(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.forward(*args)
        except RuntimeError as exc:  # e.g. a MoE layer that copies a host tensor per step
            raise GraphCaptureError(str(exc)) from exc
        torch.cuda.synchronize(self.device)
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return graph, out

    def run(self, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, tables: np.ndarray,
            lens: np.ndarray, fca: bool, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Fill the buffers (padding rows included) and replay; returns ``[B, V]`` logits.
        ``device_ids``: the token ids as a device tensor ``[B]`` (the previous step's sampled
        tokens, never seen by the host), used instead of ``ids``. The pinned staging buffers
        take turns (``readback.PINNED_TURNS``): the copy out of a buffer has finished when its
        turn comes again."""
        batch = len(ids)
        b = self.bucket(batch)
        self._stage(b, ids, pos, slots, tables, lens, device_ids)
        if (b, fca) not in self.graphs:
            self.graphs[(b, fca)] = self._capture(b, fca)
        graph, out = self.graphs[(b, fca)]
        graph.replay()
        return out[:batch]

    def _stage(self, b: int, ids, pos, slots, tables: np.ndarray, lens, device_ids) -> None:
        """The step's inputs into the static buffers of bucket ``b``: one pinned ``[b, 4 +
        used columns]`` int64 block (id, position, slot, length, table row) to the device."""
        batch = len(ids)
        used = tables.shape[1]
        if not 1 <= used <= self.width:
            raise ValueError(f"block tables of {used} columns for graphs {self.width} wide")
        host = self.hosts[self._turn][:b * (4 + used)].view(b, 4 + used)
        self._turn = (self._turn + 1) % PINNED_TURNS
        host.zero_()
        h = host.numpy()
        h[:batch, 0], h[:batch, 1], h[:batch, 2], h[:batch, 3] = ids, pos, slots, lens
        h[batch:, 2] = self.scratch * self.block_size
        h[batch:, 3] = 1
        h[:batch, 4:] = tables
        h[batch:, 4] = self.scratch
        dev = host.to(self.device, non_blocking=True)
        self.staged_bytes = host.numel() * host.element_size()
        self._fill(b, batch, dev[:, 0], dev[:, 1], dev[:, 2], dev[:, 3], dev[:, 4:], device_ids)
        if used < self._zero_from:  # a narrower step: clear what wider ones left (all rows)
            self.tables[:, used:self._zero_from].zero_()
        self._zero_from = used

    def _fill(self, b: int, batch: int, ids, pos, slots, lens, tables, device_ids) -> None:
        """Copy the staged columns (device views, ``b`` rows) into the static buffers; the
        tables into their first ``tables.shape[1]`` columns."""
        self.ids[0, :b].copy_(ids)
        if device_ids is not None:
            self.ids[0, :batch].copy_(device_ids)
        self.pos[0, :b].copy_(pos)
        self.slots[:b].copy_(slots)
        self.lens[:b].copy_(lens)
        self.tables[:b, :tables.shape[1]].copy_(tables)

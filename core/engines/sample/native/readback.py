"""Steps' sampled tokens and log-probs on their way to the host: async copies, one event each.

``start`` queues a device-to-host copy into a reused pinned buffer behind the step's kernels
and returns at once; ``result`` waits for the oldest copy not yet read (not for later work on
the stream). The engine may launch the next step before it reads this one back (async
scheduling launches a decode step speculatively), so up to ``SLOTS`` copies are in flight, each
in its own buffer; ``discard`` drops the newest unread one (a step whose rows all stopped: its
copy still lands, into a buffer nobody reads before a later copy overwrites it in stream order).
On the CPU the values are simply there.
"""
from __future__ import annotations

from collections import deque

import torch

SLOTS = 2  # copies in flight: the step being read back and the one launched ahead of it
# host-to-device staging buffers of a step's inputs, taken in turn: between the read-back of
# step n and that of step n + 1 the engine may launch step n + 1 early, drop it, launch it
# again and launch step n + 2 early; the buffer of a step whose kernels ran is free again
PINNED_TURNS = 3


class Readback:
    """Reads ``(tokens [B] int64, logprobs [B] float32)`` back as Python lists, exactly (both
    travel as float64: token ids are far below 2**53, float32 values convert exactly)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * SLOTS
        self._events = [torch.cuda.Event() for _ in range(SLOTS)] if self.cuda else None
        self._next = 0  # the slot the next start() fills
        self._pending: deque[tuple[torch.Tensor, int]] = deque()  # (host view, slot), oldest first

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        if len(self._pending) >= SLOTS:
            raise RuntimeError(f"more than {SLOTS} read-backs in flight (result() first)")
        both = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))
        slot = self._next
        self._next = (slot + 1) % SLOTS
        if not self.cuda:
            self._pending.append((both, slot))
            return
        n = both.numel()
        buf = self._bufs[slot]
        if buf is None or buf.numel() < n:
            buf = self._bufs[slot] = torch.empty(max(n, 128), dtype=torch.float64).pin_memory()
        host = buf[:n].view(both.shape)  # contiguous: one async copy, no staging
        host.copy_(both, non_blocking=True)
        self._events[slot].record(torch.cuda.current_stream(self.device))  # the engine's device
        self._pending.append((host, slot))

    def result(self) -> tuple[list[int], list[float]]:
        """Wait for the oldest copy ``start`` queued; its tokens and log-probs as lists."""
        assert self._pending, "result() without start()"
        host, slot = self._pending.popleft()
        if self._events is not None:
            self._events[slot].synchronize()
        return host[0].long().tolist(), host[1].tolist()

    def discard(self) -> None:
        """Forget the newest copy not read yet (its step's results are not wanted)."""
        assert self._pending, "discard() without start()"
        self._pending.pop()
        self._next = (self._next - 1) % SLOTS

    def clear(self) -> None:
        """Forget every copy not read yet (a failed step: none of them is booked)."""
        self._pending.clear()

"""A step's sampled tokens and log-probs on their way to the host: one async copy, one event.

``start`` queues a device-to-host copy into a reused pinned buffer behind the step's kernels
and returns at once; ``result`` waits for that copy only (not for later work on the stream).
The engine reads one step back before it launches the step after next, so one buffer and one
event serve every step. On the CPU the values are simply there.
"""
from __future__ import annotations

import torch


class Readback:
    """Reads ``(tokens [B] int64, logprobs [B] float32)`` back as Python lists, exactly (both
    travel as float64: token ids are far below 2**53, float32 values convert exactly)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.buf: torch.Tensor | None = None
        self.event = torch.cuda.Event() if self.cuda else None
        self.host: torch.Tensor | None = None

    def start(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        both = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))
        if not self.cuda:
            self.host = both
            return
        n = both.numel()
        if self.buf is None or self.buf.numel() < n:
            self.buf = torch.empty(max(n, 128), dtype=torch.float64).pin_memory()
        self.host = self.buf[:n].view(both.shape)  # contiguous: one async copy, no staging
        self.host.copy_(both, non_blocking=True)
        self.event.record(torch.cuda.current_stream(self.device))  # the engine's device, not the current one

    def result(self) -> tuple[list[int], list[float]]:
        """Wait for the copy ``start`` queued; the tokens and log-probs as lists."""
        assert self.host is not None, "result() without start()"
        if self.event is not None:
            self.event.synchronize()
        host, self.host = self.host, None
        return host[0].long().tolist(), host[1].tolist()

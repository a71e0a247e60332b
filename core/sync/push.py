"""In-process weight push: a framework's module -> a polynya engine in the same process, verified.

For adapters whose trainer is the framework's own module (TRL), not a polynya
``TrainingEngine``::

    push = WeightPush()                                   # keep it: caches the staging layout
    checksum = push(engine, policy.named_parameters(),    # SyncError: refused, engine unchanged
                    gather=None)                          # ZeRO-3: gather_params(list) context

Per push, whichever way below, a fixed handful of launches and three host syncs (the
expected checksum, the engine's check, its checksum after), not a few per tensor: the checksums
go through ``polynya.checksum``'s O(1)-launch paths (under ZeRO-3, plus one gather and one
multi-tensor copy per chunk).

1. **direct** — the parameters are whole (no ``gather``) and already in the engine's dtype: the
   expected checksum is the parameters' own (``checksum_views``); the engine loads them as
   ``(name, tensor)`` pairs, checking names, shapes, NaN/inf and that checksum in one read
   before anything is copied, then copies them with one multi-tensor copy. No extra memory.
2. **staged** — a cast to the engine's dtype or a ZeRO-3 gather is needed: the parameters are
   copied into one flat staging buffer of the engine's dtype on its device (one
   ``_foreach_copy_``, or per gathered chunk of about ``chunk_bytes`` under ZeRO-3; every
   tensor 16-byte aligned in it), whose checksum is the expected one (the definition: the
   weights cast to the engine's dtype); the engine gets it as ``FlatBuckets``, which the native
   sampler verifies and copies with ``VerifiedBucketCopy`` (one read to check, one to copy;
   nothing written on a refusal). The buffer costs **one extra copy of the weights in the
   engine's dtype** (1.19 GB for Qwen3-0.6B in bf16) and is kept for the next push while the
   layout (names, shapes, dtype, device) stays the same; ``release()`` frees it.

Either way the engine's ``weight_checksum()`` after the load must equal the expected checksum
(``SyncError`` otherwise). Direct: the engine's weights are proved equal to the module's.
Staged: they are proved equal to the staging buffer; the step that filled it (torch's
``_foreach_copy_`` cast, DeepSpeed's gather) is trusted, not re-checked — its NaN/inf are
caught, since the engine checks the buffer.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import torch

from ..checksum import checksum_views, specs_checksum
from ..config.common import resolve_dtype
from ..weights import BucketSpec, FlatBuckets, full_shape
from .manifest import SyncError

ALIGN_BYTES = 16  # every staged tensor starts here (the digest kernels read 8-byte words)


class FlatStage:
    """Named tensors of fixed shapes in one flat buffer of ``dtype`` on ``device`` (span layout:
    each tensor starts on a 16-byte boundary; gaps are zero and never read as weights)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device):
        step = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        offsets, pos = [], 0
        for shape in shapes:
            pos = -(-pos // step) * step
            offsets.append(pos)
            pos += int(torch.Size(shape).numel())
        self.spec = BucketSpec(tuple(names), tuple(tuple(int(x) for x in s) for s in shapes),
                               tuple(offsets), pos)
        self.dtype, self.device = dtype, torch.device(device)
        self.flat = torch.zeros(pos, dtype=dtype, device=device)
        self.views = [v for _, v in self.spec.views(self.flat)]

    def buckets(self) -> FlatBuckets:
        return FlatBuckets([self.spec], [self.flat])

    def checksum(self) -> str:
        """``polynya.checksum`` of the staged tensors (digest plan cached per layout)."""
        return specs_checksum([self.spec], self.dtype, [self.flat])


class WeightPush:
    """Pushes named parameters into an engine (module docstring); keeps the staging buffer.

    Args:
        chunk_bytes: under ZeRO-3, parameters are gathered in chunks of about this many bytes
            (one gather and one multi-tensor copy per chunk).
    """

    def __init__(self, *, chunk_bytes: int = 1 << 28):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = int(chunk_bytes)
        self._stage: FlatStage | None = None
        self.last_path: str | None = None  # "direct" or "staged": what the last push did

    def release(self) -> None:
        """Free the staging buffer (the next staged push allocates it again)."""
        self._stage = None

    def __call__(self, engine, params: Iterable[tuple[str, torch.Tensor]], *,
                 gather: Callable[[list], contextlib.AbstractContextManager] | None = None) -> str:
        """Load ``params`` into ``engine`` (its ``load_weights`` / ``weight_checksum`` /
        ``config.dtype`` / ``device``); returns the checksum both now have. ``gather``: a
        context manager factory that makes a list of ZeRO-3 parameters whole (None: they are).
        ``SyncError`` when the engine refuses (NaN/inf, checksum mismatch: it is unchanged) or
        its weights afterwards do not hash to the parameters' checksum."""
        params = [(n, p) for n, p in params]
        dtype = resolve_dtype(engine.config.dtype)  # "bf16", "bfloat16" or a torch.dtype
        if gather is None and all(p.dtype == dtype for _, p in params):
            self.last_path = "direct"
            expected = checksum_views(params)  # the parameters themselves (no per-tensor op)
            weights = params
        else:
            self.last_path = "staged"
            stage = self._stage_for(params, dtype, engine.device)
            self._fill(stage, [p for _, p in params], gather)
            expected = stage.checksum()
            weights = stage.buckets()
        try:
            engine.load_weights(weights, checksum=expected)  # checked before anything is copied
        except ValueError as exc:
            raise SyncError(f"push of the weights refused (engine unchanged): {exc}") from exc
        got = engine.weight_checksum()
        if got != expected:
            raise SyncError(f"engine weights after the push hash to {got}, the pushed ones to "
                            f"{expected}")
        return expected

    def _stage_for(self, params, dtype: torch.dtype, device) -> FlatStage:
        names = [n for n, _ in params]
        shapes = [tuple(full_shape(p)) for _, p in params]
        s = self._stage
        if (s is None or s.dtype != dtype or s.device != torch.device(device)
                or list(s.spec.names) != names or list(s.spec.shapes) != shapes):
            self._stage = None  # free the old buffer before the new one is allocated
            self._stage = s = FlatStage(names, shapes, dtype, device)
        return s

    def _fill(self, stage: FlatStage, params: list[torch.Tensor], gather) -> None:
        """Copy (cast) ``params`` into the stage: one ``_foreach_copy_``, or under ``gather``
        one gather + copy per chunk of about ``chunk_bytes``."""
        with torch.no_grad():
            if gather is None:
                torch._foreach_copy_(stage.views, params)
                return
            start = 0
            while start < len(params):
                end, size = start, 0
                while end < len(params) and (end == start or size < self.chunk_bytes):
                    p = params[end]
                    size += torch.Size(full_shape(p)).numel() * p.element_size()
                    end += 1
                chunk = params[start:end]
                with gather(chunk):
                    torch._foreach_copy_(stage.views[start:end], [p.data for p in chunk])
                start = end

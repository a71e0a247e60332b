"""Launcher of the weight digest: ``DigestPlan`` (Triton on CUDA, ``reference.py`` elsewhere).

A ``DigestPlan`` describes where tensors lie in a few flat 1-D buffers (tensor ``k`` of group
``g`` is ``flats[g][start:start + n]``); it is built once per weight layout and keeps its block
tables on the device. On CUDA one call takes two launches per flat buffer and no host sync
(``digest_tensor``): the first kernel reads the weights once (a partial sum per block of
``BLOCK`` elements), the second adds each tensor's partial sums. Elsewhere each tensor goes
through ``digest_reference``: the same bits either way.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from . import reference as ref

BLOCK = 4096  # elements per program of the digest kernel
RBLOCK = 2048  # partial sums per iteration of the per-tensor sum
MAX_TENSOR = 2**31 - BLOCK  # the kernels index inside a tensor in int32
KERNEL_ON_CPU = False  # tests: the Triton path for CPU tensors too (TRITON_INTERPRET=1)


@functools.lru_cache(maxsize=1)
def have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def tensor_digest(t: torch.Tensor) -> int:
    """The digest of one tensor's bits (``reference.py``), as a Python int."""
    return ref.digest_reference(ref.bits_view(t))


class DigestPlan:
    """Digests of tensors lying in flat buffers: ``groups[g] = (starts, lengths)`` (element
    offsets into ``flats[g]``). Built once per layout; ``digests(flats)`` per call."""

    def __init__(self, groups: Sequence[tuple[Sequence[int], Sequence[int]]]):
        self.starts = [tuple(int(s) for s in st) for st, _ in groups]
        self.lengths = [tuple(int(n) for n in ln) for _, ln in groups]
        for st, ln in zip(self.starts, self.lengths):
            if len(st) != len(ln) or any(s < 0 for s in st) or any(n < 0 for n in ln):
                raise ValueError("a digest plan needs one non-negative start per tensor length")
        self.num_tensors = sum(len(ln) for ln in self.lengths)
        self.extents = [max((s + n for s, n in zip(st, ln)), default=0)  # elements each flat needs
                        for st, ln in zip(self.starts, self.lengths)]
        self.fits_kernel = all(n < MAX_TENSOR for ln in self.lengths for n in ln)
        self._device: dict[torch.device, tuple] = {}
        self._lock = threading.Lock()

    def _tables(self, device: torch.device) -> tuple:
        """Per group ``(blk_tensor, blk_start, base, length, partial offset, blocks)`` and the
        per-tensor ``(first partial, count)`` on ``device``; made once per device. Each table
        is its own allocation and each group's partial sums start at an even index, so the
        kernels always see 16-byte aligned pointers (one compiled variant)."""
        tables = self._device.get(device)
        if tables is not None:
            return tables

        def upload(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        per_group, seg_first, seg_count, offset = [], [], [], 0
        for st, ln in zip(self.starts, self.lengths):
            offset += offset % 2
            n_blocks = [max(1, -(-n // BLOCK)) for n in ln]
            blk_tensor = [k for k, nb in enumerate(n_blocks) for _ in range(nb)]
            blk_start = [b * BLOCK for nb in n_blocks for b in range(nb)]
            group_off = offset
            for nb in n_blocks:
                seg_first.append(offset)
                seg_count.append(nb)
                offset += nb
            per_group.append((upload(blk_tensor), upload(blk_start), upload(list(st)),
                              upload(list(ln)), group_off, len(blk_tensor)))
        tables = (per_group, upload(seg_first), upload(seg_count), offset)
        with self._lock:
            self._device.setdefault(device, tables)
        return self._device[device]

    def kernel_ok(self, flats: Sequence[torch.Tensor]) -> bool:
        """Whether the Triton path can read ``flats`` (CUDA, or any device with KERNEL_ON_CPU)."""
        if not self.fits_kernel or len(flats) != len(self.starts) or not have_triton():
            return False
        dev = flats[0].device if flats else None
        return all(
            (f.is_cuda or KERNEL_ON_CPU) and f.device == dev and f.dim() == 1 and f.is_contiguous()
            and f.numel() >= e and f.element_size() in ref.BITS
            for f, e in zip(flats, self.extents)
        )

    def _check(self, flats: Sequence[torch.Tensor]) -> None:
        if len(flats) != len(self.starts):
            raise ValueError(f"{len(flats)} flat buffers for a plan of {len(self.starts)}")
        for f, e in zip(flats, self.extents):
            if f.numel() < e:
                raise ValueError(f"a flat buffer of {f.numel()} elements; the plan needs {e}")

    def digest_tensor(self, flats: Sequence[torch.Tensor], *, kernel: bool | None = None
                      ) -> torch.Tensor:
        """The digests as an int64 tensor (on the flats' device on the kernel path: no host
        sync). ``kernel``: force (tests, with ``TRITON_INTERPRET``) or forbid the Triton path."""
        self._check(flats)
        if kernel is None:
            kernel = self.kernel_ok(flats)
        if not kernel:
            return torch.tensor(self.reference(flats), dtype=torch.int64)
        dev = flats[0].device
        if dev.type == "cuda" and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):  # Triton launches on the current device
                return self._launch(flats, dev)
        return self._launch(flats, dev)

    def _launch(self, flats: Sequence[torch.Tensor], dev: torch.device) -> torch.Tensor:
        from .kernel import _digest_blocks_kernel, _segment_sum_kernel

        per_group, seg_first, seg_count, total = self._tables(dev)
        partial = torch.empty(total, dtype=torch.int64, device=dev)
        s1, s2, s3 = ref.SHIFTS
        for flat, (blk_tensor, blk_start, base, length, off, nb) in zip(flats, per_group):
            if not nb:
                continue
            bits = flat.view(ref.BITS[flat.element_size()])
            out = partial if off == 0 else partial[off:]
            _digest_blocks_kernel[(nb,)](
                bits, blk_tensor, blk_start, base, length, out,
                VMASK=ref.value_mask(flat.element_size()), GAMMA=ref.GAMMA, KEY=ref.KEY,
                M1=ref.M1, M2=ref.M2, S1=s1, S2=s2, S3=s3, K1=ref.shift_mask(s1),
                K2=ref.shift_mask(s2), K3=ref.shift_mask(s3), BLOCK=BLOCK)
        sums = torch.empty(self.num_tensors, dtype=torch.int64, device=dev)
        if self.num_tensors:
            _segment_sum_kernel[(self.num_tensors,)](partial, seg_first, seg_count, sums,
                                                     RBLOCK=RBLOCK)
        return sums

    def digests(self, flats: Sequence[torch.Tensor], *, kernel: bool | None = None) -> list[int]:
        """The digest of every tensor, groups in order (one device -> host transfer)."""
        return self.digest_tensor(flats, kernel=kernel).tolist()

    def reference(self, flats: Sequence[torch.Tensor]) -> list[int]:
        """``digest_reference`` of every tensor (the torch path)."""
        self._check(flats)
        return [tensor_digest(flat.reshape(-1)[s:s + n])
                for flat, st, ln in zip(flats, self.starts, self.lengths) for s, n in zip(st, ln)]

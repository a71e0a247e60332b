"""Launcher of the weight digest: ``DigestPlan`` (Triton on CUDA, ``reference.py`` elsewhere).

A ``DigestPlan`` describes where tensors lie in a few flat 1-D buffers (tensor ``k`` of group
``g`` is ``flats[g][start:start + n]``); it is built once per weight layout and keeps its block
tables on the device. The digest mixes 64-bit words of raw bytes (``reference.py``): a tensor
whose bytes start and end on 8-byte boundaries of an aligned buffer (every weight of the usual
model shapes) is read by the kernels as int64 words in place; any other tensor goes through
``digest_tensor_reference`` on its device (still no host sync). On CUDA one call takes two
launches per flat buffer (``digest_tensor``): the first kernel reads the words once (a partial
sum per block of ``BLOCK`` words), the second adds each tensor's partial sums. Elsewhere each
tensor goes through ``digest_reference``: the same bits either way.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from . import reference as ref

BLOCK = 4096  # 64-bit words per program of the digest kernel
RBLOCK = 2048  # partial sums per iteration of the per-tensor sum
MAX_TENSOR = 2**31 - BLOCK  # the kernels index inside a tensor in int32 (elements; words fewer)
WORD = 8  # bytes per digest word
KERNEL_ON_CPU = False  # tests: the Triton path for CPU tensors too (TRITON_INTERPRET=1)


@functools.lru_cache(maxsize=1)
def have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def word_view(flat: torch.Tensor) -> torch.Tensor:
    """A 1-D buffer's whole 64-bit words in place (its data must start 8-byte aligned)."""
    storage = flat.untyped_storage()
    start = flat.data_ptr() - storage.data_ptr()
    return torch.empty(0, dtype=torch.int64, device=flat.device).set_(
        storage, start // WORD, (flat.numel() * flat.element_size() // WORD,))


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

    def _tables(self, device: torch.device, sizes: tuple[int, ...]) -> tuple:
        """Per group ``(blk_tensor, blk_start, base, length, partial offset, blocks)`` of its
        word-aligned tensors (offsets in words), the per-tensor ``(first partial, count)``,
        the global indices of the kernel's tensors and ``(index, group, start, n)`` of the
        others; made once per device and element sizes. Each table is its own allocation and
        each group's partial sums start at an even index, so the kernels always see 16-byte
        aligned pointers (one compiled variant)."""
        key = (device, sizes)
        tables = self._device.get(key)
        if tables is not None:
            return tables

        def upload(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        per_group, seg_first, seg_count, offset = [], [], [], 0
        kernel_index, others, index = [], [], 0
        for g, (st, ln, es) in enumerate(zip(self.starts, self.lengths, sizes)):
            offset += offset % 2
            words_st, words_ln = [], []
            for s, n in zip(st, ln):
                if (s * es) % WORD or (n * es) % WORD:
                    others.append((index, g, s, n))
                else:
                    kernel_index.append(index)
                    words_st.append(s * es // WORD)
                    words_ln.append(n * es // WORD)
                index += 1
            n_blocks = [max(1, -(-n // BLOCK)) for n in words_ln]
            blk_tensor = [k for k, nb in enumerate(n_blocks) for _ in range(nb)]
            blk_start = [b * BLOCK for nb in n_blocks for b in range(nb)]
            group_off = offset
            for nb in n_blocks:
                seg_first.append(offset)
                seg_count.append(nb)
                offset += nb
            per_group.append((upload(blk_tensor), upload(blk_start), upload(words_st),
                              upload(words_ln), group_off, len(blk_tensor)))
        every = kernel_index == list(range(self.num_tensors))
        tables = (per_group, upload(seg_first), upload(seg_count), offset,
                  None if every else upload(kernel_index), others)
        with self._lock:
            self._device.setdefault(key, tables)
        return self._device[key]

    def kernel_ok(self, flats: Sequence[torch.Tensor]) -> bool:
        """Whether the Triton path can read ``flats`` (CUDA, or any device with KERNEL_ON_CPU):
        one device, contiguous 1-D buffers of a known element width starting 8-byte aligned."""
        if not self.fits_kernel or len(flats) != len(self.starts) or not have_triton():
            return False
        dev = flats[0].device if flats else None
        return all(
            (f.is_cuda or KERNEL_ON_CPU) and f.device == dev and f.dim() == 1 and f.is_contiguous()
            and f.numel() >= e and f.element_size() in ref.BITS and f.data_ptr() % WORD == 0
            and f.untyped_storage().data_ptr() % WORD == 0
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

        sizes = tuple(f.element_size() for f in flats)
        per_group, seg_first, seg_count, total, kernel_index, others = self._tables(dev, sizes)
        partial = torch.empty(max(total, 1), dtype=torch.int64, device=dev)
        s1, s2, s3 = ref.SHIFTS
        for flat, (blk_tensor, blk_start, base, length, off, nb) in zip(flats, per_group):
            if not nb:
                continue
            out = partial if off == 0 else partial[off:]
            _digest_blocks_kernel[(nb,)](
                word_view(flat), blk_tensor, blk_start, base, length, out,
                VMASK=0, GAMMA=ref.GAMMA, KEY=ref.KEY,
                M1=ref.M1, M2=ref.M2, S1=s1, S2=s2, S3=s3, K1=ref.shift_mask(s1),
                K2=ref.shift_mask(s2), K3=ref.shift_mask(s3), BLOCK=BLOCK)
        count = len(seg_count)
        sums = torch.empty(count, dtype=torch.int64, device=dev)
        if count:
            _segment_sum_kernel[(count,)](partial, seg_first, seg_count, sums, RBLOCK=RBLOCK)
        if kernel_index is None:
            return sums
        out = torch.zeros(self.num_tensors, dtype=torch.int64, device=dev)
        if count:
            out[kernel_index] = sums
        for index, g, s, n in others:  # tensors off the 8-byte grid: torch, on the device
            out[index] = ref.digest_tensor_reference(ref.bits_view(flats[g][s:s + n]))
        return out

    def digests(self, flats: Sequence[torch.Tensor], *, kernel: bool | None = None) -> list[int]:
        """The digest of every tensor, groups in order (one device -> host transfer)."""
        return self.digest_tensor(flats, kernel=kernel).tolist()

    def reference(self, flats: Sequence[torch.Tensor]) -> list[int]:
        """``digest_reference`` of every tensor (the torch path)."""
        self._check(flats)
        return [tensor_digest(flat.reshape(-1)[s:s + n])
                for flat, st, ln in zip(flats, self.starts, self.lengths) for s, n in zip(st, ln)]

"""Digest and NaN/inf-check tensors that each have their own storage: ``ScatterPlan``.

A model's parameters are usually one allocation each (transformers allocates every parameter
on its own), so ``DigestPlan`` / ``CopyPlan``, which read a few flat buffers, cost two launches
per parameter there. A ``ScatterPlan`` addresses every tensor by its distance in 64-bit words
from the lowest address among them: ``_copy_digest_kernel`` (``kernel.py``) gets that one
pointer and a table of offsets, so any number of tensors take one launch per dtype (one in
all for a model in one dtype) plus one ``_segment_sum_kernel`` launch for the per-tensor sums,
and the caller one device -> host transfer::

    plan = ScatterPlan(tensors)                            # once per layout (cache it)
    digests, bad = plan.scan(tensors, finite=True)         # int64 [n] each, on the device

The plan depends only on where the tensors lie and what they are (addresses, dtypes, shapes,
contiguity), never on their values, and keeps no reference to them: ``scan`` reads whatever
the tensors passed to it hold at those addresses (``ValueError`` when they lie elsewhere).
Tensors the kernel cannot read in place as whole words — not contiguous, not starting or
ending on the 8-byte grid, ``>= 2**31`` elements, a floating dtype the kernel's NaN/inf test
does not cover (float8 other than e4m3fn / e5m2) — take the torch path on their device
(``digest_tensor_reference``, ``isfinite``); ``fallback`` counts them. Empty tensors digest to
0 and are finite without a read. Digests equal ``reference.py`` bit for bit; a NaN/inf count is
zero iff the tensor is finite (the kernel counts words holding one, torch counts values).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import op
from . import reference as ref
from .copy import NUM_WARPS, VECTOR_BYTES, finite_check_in_kernel, finite_lanes, non_finite_count
from .op import MAX_TENSOR, have_triton


def layout_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """What a ``ScatterPlan`` depends on, per tensor: address, dtype, shape, contiguity,
    device (cheap: no tensor data is read; a cache of plans is keyed by it)."""
    return tuple((t.data_ptr(), t.dtype, t.shape, t.is_contiguous(), t.device) for t in tensors)


def kernel_reads(t: torch.Tensor) -> bool:
    """Whether the kernel reads ``t`` in place: contiguous, non-empty, whole 64-bit words from
    an 8-byte aligned address, fewer than ``MAX_TENSOR`` elements, a dtype whose NaN/inf test
    the kernel knows."""
    es = t.element_size()
    return (t.numel() > 0 and t.is_contiguous() and es in ref.BITS and t.numel() < MAX_TENSOR
            and t.data_ptr() % op.WORD == 0 and (t.numel() * es) % op.WORD == 0
            and finite_check_in_kernel(t.dtype))


class ScatterPlan:
    """Launch tables of tensors in separate storages on one device (module docstring)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        tensors = list(tensors)
        self.num_tensors = len(tensors)
        self.device = tensors[0].device if tensors else torch.device("cpu")
        if any(t.device != self.device for t in tensors):
            raise ValueError("a scatter plan needs every tensor on one device")
        self.ptrs = tuple(t.data_ptr() for t in tensors)
        self.key = layout_key(tensors)
        kernel, self.others = {}, []
        for i, t in enumerate(tensors):
            if kernel_reads(t):
                kernel.setdefault(t.dtype, []).append(i)
            elif t.numel():
                self.others.append(i)
        self.fallback = len(self.others)
        self._built: tuple | None = None
        self._plan_groups = [  # (dtype, members, their addresses, their lengths in words)
            (dtype, members, [self.ptrs[i] for i in members],
             [tensors[i].numel() * tensors[i].element_size() // op.WORD for i in members])
            for dtype, members in kernel.items()]

    def _tables(self) -> tuple:
        """Per dtype ``(dtype, base index, blk_tensor, blk_start, offsets, lengths, partial
        offset, blocks, align)`` (offsets from the group's lowest tensor and lengths in 64-bit
        words) and the per-tensor segment tables in the tensors' order (digest partials first,
        NaN/inf partials ``total`` after them; the NaN/inf half of the table starts at the
        even index ``half``; a tensor the kernel does not read has no partials: its sums are 0
        and the torch path fills it in). Uploaded once."""
        if self._built is not None:
            return self._built
        dev = self.device

        def upload(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(dev)

        seg_first, seg_count = [0] * self.num_tensors, [0] * self.num_tensors
        groups, offset = [], 0
        for dtype, members, ptrs, lens in self._plan_groups:
            offset += offset % 2  # each group's partials 16-byte aligned (one kernel variant)
            base_k = min(range(len(ptrs)), key=ptrs.__getitem__)
            base_ptr = ptrs[base_k]
            offs = [(p - base_ptr) // op.WORD for p in ptrs]
            align = math.gcd(VECTOR_BYTES // op.WORD, *offs, *lens)
            if base_ptr % VECTOR_BYTES:
                align = 1
            n_blocks = [-(-n // op.BLOCK) for n in lens]
            blk_tensor = [k for k, nb in enumerate(n_blocks) for _ in range(nb)]
            blk_start = [b * op.BLOCK for nb in n_blocks for b in range(nb)]
            group_off = offset
            for i, nb in zip(members, n_blocks):
                seg_first[i], seg_count[i] = offset, nb
                offset += nb
            groups.append((dtype, members[base_k], upload(blk_tensor), upload(blk_start),
                           upload(offs), upload(lens), group_off, len(blk_tensor), align))
        total = offset + offset % 2
        pad = [0] * (self.num_tensors % 2)  # the second half starts 16-byte aligned too
        self._built = (groups, upload(seg_first + pad + [f + total for f in seg_first]),
                       upload(seg_count + pad + seg_count), total)
        return self._built

    def kernel_ok(self) -> bool:
        """Whether ``scan`` takes the Triton path (CUDA, or any device with KERNEL_ON_CPU)."""
        return have_triton() and (self.device.type == "cuda" or op.KERNEL_ON_CPU)

    def scan(self, tensors: Sequence[torch.Tensor], *, digest: bool = True, finite: bool = False,
             key: tuple | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(digests, NaN/inf counts)`` of ``tensors`` (int64 ``[n]``, on the plan's device on
        the kernel path; each None when not asked for), one read of the tensors. ``tensors``
        must have the plan's ``layout_key`` (addresses, dtypes, shapes, contiguity, devices;
        ``ValueError`` otherwise: make a new plan); ``key``: that key when the caller already
        computed it from ``tensors``."""
        tensors = list(tensors)
        if (key if key is not None else layout_key(tensors)) != self.key:
            raise ValueError("these tensors do not lie where the scatter plan's did; make a new plan")
        if not (digest or finite):
            return None, None
        if not self.kernel_ok():
            return self._reference(tensors, digest=digest, finite=finite)
        if self.device.type == "cuda" and self.device.index != torch.cuda.current_device():
            with torch.cuda.device(self.device):  # Triton launches on the current device
                return self._launch(tensors, digest=digest, finite=finite)
        return self._launch(tensors, digest=digest, finite=finite)

    def _reference(self, tensors, *, digest: bool, finite: bool):
        dev = self.device
        d = torch.tensor([ref.digest_reference(ref.bits_view(t)) if t.numel() else 0
                          for t in tensors], dtype=torch.int64, device=dev) if digest else None
        b = torch.tensor([int(non_finite_count(t)) for t in tensors], dtype=torch.int64,
                         device=dev) if finite else None
        return d, b

    def _launch(self, tensors, *, digest: bool, finite: bool):
        from .kernel import _copy_digest_kernel, _segment_sum_kernel

        groups, seg_first, seg_count, total = self._tables()
        dev, n = self.device, self.num_tensors
        half = n + n % 2
        partial = torch.zeros(2 * total + 2, dtype=torch.int64, device=dev)
        s1, s2, s3 = ref.SHIFTS
        for dtype, base, blk_tensor, blk_start, offs, lens, off, nb, align in groups:
            words = tensors[base].detach().reshape(-1).view(torch.int64)
            expw, ones, high = finite_lanes(dtype) if finite else (0, 0, 0)
            _copy_digest_kernel[(nb,)](
                words, words, blk_tensor, blk_start, offs, offs, lens,
                partial[off:], partial[total + off:],
                DIGEST=digest, COPY=False, EXPW=expw, ONES=ones, HIGH=high, ALIGN=align,
                GAMMA=ref.GAMMA, KEY=ref.KEY, M1=ref.M1, M2=ref.M2, S1=s1, S2=s2, S3=s3,
                K1=ref.shift_mask(s1), K2=ref.shift_mask(s2), K3=ref.shift_mask(s3),
                BLOCK=op.BLOCK, num_warps=NUM_WARPS)
        # digests of tensors 0..n-1, then (from index ``half``) their NaN/inf counts
        first, count = (0, half + n) if finite and digest else ((0, n) if digest else (half, n))
        sums = torch.empty(count, dtype=torch.int64, device=dev)
        if count:
            _segment_sum_kernel[(count,)](partial, seg_first[first:], seg_count[first:], sums,
                                          RBLOCK=op.RBLOCK)
        d = sums[:n] if digest else None
        b = (sums[half:] if digest else sums) if finite else None
        for i in self.others:  # off the 8-byte grid or not contiguous: torch on the device
            t = tensors[i]
            if d is not None:
                d[i] = ref.digest_tensor_reference(ref.bits_view(t))
            if b is not None:
                b[i] = non_finite_count(t)
        return d, b

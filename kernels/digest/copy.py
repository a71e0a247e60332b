"""Copy tensors out of flat buffers and digest them in the same read: ``CopyPlan``.

A weight sync receives flat buckets and must (1) prove that they hash to the trainer's checksum
and hold only finite values, then (2) copy them into the receiver's parameters. ``CopyPlan``
does both with ``_copy_digest_kernel`` (``kernel.py``): one launch per flat buffer covers every
tensor in it through a table of ``(block -> tensor)``, ``(source offset, destination offset,
length)`` in 64-bit words, built once per layout, plus one launch that sums each tensor's
partials (digest and NaN/inf count)::

    plan = CopyPlan([(starts, lengths, dsts)])        # once per layout; dsts: contiguous tensors
    digests, bad = plan.check(flats)                  # one read: digests, NaN/inf counts
    plan.copy(flats)                                  # one launch per flat: the bytes into dsts
    digests, bad = plan.copy(flats, digest=True)      # one read: copy + digest + finite check

``check`` and ``copy(digest=True)`` return int64 tensors on the device (no host sync); a
count is zero iff the tensor is finite (the kernel counts words holding a NaN/inf, torch
counts values). The digests are bit-identical to ``reference.py``. The kernel reads a tensor
in place when its bytes start and end on the 8-byte grid of an aligned buffer (and its
destination is 8-byte aligned): every weight of the usual model shapes. Other tensors take
torch on the device (``digest_tensor_reference``, ``Tensor.copy_``), as does everything on
CPU tensors (unless ``op.KERNEL_ON_CPU``) or without Triton. Destinations are addressed
relative to the lowest one (one pointer argument), so they must be on the sources' device in
the sources' dtype.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from . import op
from . import reference as ref
from .op import MAX_TENSOR, have_triton

# per floating dtype the bits that are all ones exactly in its NaN and inf values (the exponent;
# float8_e4m3fn has no inf and one NaN pattern per sign, S.1111.111). A floating dtype missing
# here (float8 *fnuz, e8m0, ...) never takes the kernel path: its NaN/inf check is torch's.
EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000,
            torch.float64: 0x7FF0000000000000, torch.float8_e5m2: 0x7C, torch.float8_e4m3fn: 0x7F}
VECTOR_BYTES = 16  # widest load/store the launcher asks the compiler to assume
NUM_WARPS = 4  # per program of BLOCK elements (bench_sync's receive arm also times 8)


def exponent_mask(dtype: torch.dtype) -> int:
    return EXPONENT.get(dtype, 0)


def finite_check_in_kernel(dtype: torch.dtype) -> bool:
    """Whether the kernel's NaN/inf test covers ``dtype`` (integer dtypes have nothing to test)."""
    return dtype in EXPONENT or not dtype.is_floating_point


class CopyPlan:
    """Tensors of a few flat buffers with their destinations: ``groups[g] = (starts, lengths,
    dsts)`` (tensor ``k`` of group ``g`` is ``flats[g][starts[k]:starts[k] + lengths[k]]`` and
    goes to ``dsts[k]``, a contiguous tensor of that many elements). Holds the destinations (a
    plan must be dropped when they move). ``dsts`` may be ``None`` (check only)."""

    def __init__(self, groups: Sequence[tuple[Sequence[int], Sequence[int], Sequence | None]], *,
                 num_warps: int = NUM_WARPS):
        self.num_warps = int(num_warps)
        self.starts = [tuple(int(s) for s in st) for st, _, _ in groups]
        self.lengths = [tuple(int(n) for n in ln) for _, ln, _ in groups]
        self.dsts = [None if d is None else [t.detach() for t in d] for _, _, d in groups]
        for st, ln, d in zip(self.starts, self.lengths, self.dsts):
            if len(st) != len(ln) or any(s < 0 for s in st) or any(n < 0 for n in ln):
                raise ValueError("a copy plan needs one non-negative start per tensor length")
            if d is not None and (len(d) != len(ln) or any(t.numel() != n for t, n in zip(d, ln))):
                raise ValueError("a copy plan needs one destination of each tensor's length")
        self.num_tensors = sum(len(ln) for ln in self.lengths)
        self.extents = [max((s + n for s, n in zip(st, ln)), default=0)
                        for st, ln in zip(self.starts, self.lengths)]
        self._device: dict[tuple, tuple] = {}  # (device, dtypes) -> launch tables
        self._dst_ok: dict[tuple, bool] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ which path
    def kernel_ok(self, flats: Sequence[torch.Tensor], *, copy: bool) -> bool:
        """Whether the Triton path can serve ``flats`` (CUDA, or any device with KERNEL_ON_CPU):
        one device, contiguous 1-D sources of a known element width, tensors < 2**31 elements,
        and (to copy) contiguous destinations of the sources' element size on that device."""
        if len(flats) != len(self.starts) or not have_triton() or not flats:
            return False
        dev = flats[0].device
        if not all((f.is_cuda or op.KERNEL_ON_CPU) and f.device == dev and f.dim() == 1
                   and f.is_contiguous() and f.numel() >= e and f.element_size() in ref.BITS
                   and f.data_ptr() % op.WORD == 0 and f.untyped_storage().data_ptr() % op.WORD == 0
                   and finite_check_in_kernel(f.dtype) for f, e in zip(flats, self.extents)):
            return False
        if any(n >= MAX_TENSOR for ln in self.lengths for n in ln):
            return False
        if copy:
            key = (dev, tuple(f.dtype for f in flats))
            ok = self._dst_ok.get(key)
            if ok is None:  # the destinations are fixed: checked once per device and dtypes
                ok = all(d is not None and all(t.device == dev and t.is_contiguous()
                                               and t.dtype == f.dtype for t in d)
                         for f, d in zip(flats, self.dsts))
                self._dst_ok[key] = ok
            return ok
        return True

    def _check_flats(self, flats: Sequence[torch.Tensor]) -> None:
        if len(flats) != len(self.starts):
            raise ValueError(f"{len(flats)} flat buffers for a plan of {len(self.starts)}")
        for f, e in zip(flats, self.extents):
            if f.numel() < e:
                raise ValueError(f"a flat buffer of {f.numel()} elements; the plan needs {e}")

    def kernel_share(self, flats: Sequence[torch.Tensor]) -> tuple[int, int]:
        """``(tensors the kernel reads as 64-bit words in place, tensors off the 8-byte grid
        that take the torch path)`` for buffers like ``flats`` on the kernel path."""
        tables = self._tables(flats[0].device, flats)
        return self.num_tensors - len(tables[5]), len(tables[5])

    # ------------------------------------------------------------------ public calls
    def check(self, flats: Sequence[torch.Tensor], *, kernel: bool | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(digests, non-finite counts)`` of every tensor (int64, groups in order), one read
        of the sources, nothing written. On the kernel path both stay on the device."""
        self._check_flats(flats)
        if kernel is None:
            kernel = self.kernel_ok(flats, copy=False)
        if not kernel:
            return self._reference(flats, copy=False)
        return self._run(flats, copy=False, digest=True)

    def copy(self, flats: Sequence[torch.Tensor], *, digest: bool = False,
             kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copy every tensor into its destination; with ``digest`` also return ``(digests,
        non-finite counts)`` of the bytes copied, from the same read."""
        self._check_flats(flats)
        if any(d is None for d in self.dsts):
            raise ValueError("this copy plan has no destinations (built to check only)")
        if kernel is None:
            kernel = self.kernel_ok(flats, copy=True)
        if not kernel:
            return self._reference(flats, copy=True, digest=digest)
        out = self._run(flats, copy=True, digest=digest)
        return out if digest else None

    # ------------------------------------------------------------------ torch path
    def _reference(self, flats, *, copy: bool, digest: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        digests, bad = [], []
        for g, (flat, st, ln) in enumerate(zip(flats, self.starts, self.lengths)):
            flat = flat.reshape(-1)
            for k, (s, n) in enumerate(zip(st, ln)):
                src = flat[s:s + n]
                if digest:
                    digests.append(ref.digest_reference(ref.bits_view(src)))
                    bad.append(non_finite_count(src))
                if copy:
                    dst = self.dsts[g][k]
                    with torch.no_grad():
                        dst.view(-1).copy_(src)
        if not digest:
            return None
        return (torch.tensor(digests, dtype=torch.int64),
                torch.tensor([int(b) for b in bad], dtype=torch.int64))

    # ------------------------------------------------------------------ Triton path
    def _tables(self, device: torch.device, flats: Sequence[torch.Tensor]) -> tuple:
        """Per group ``(blk_tensor, blk_start, src_off, dst_off, length, dst base, partial
        offset, blocks, align)`` over its word-aligned tensors (offsets and lengths in 64-bit
        words; the destination too), the per-tensor segment tables (digest partials first,
        non-finite partials after them), the global indices of the kernel's tensors and
        ``(index, group, k)`` of the others (torch path); made once per device and dtypes."""
        key = (device, tuple(f.dtype for f in flats))
        tables = self._device.get(key)
        if tables is not None:
            return tables

        def upload(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        word = op.WORD
        per_group, seg_first, seg_count, offset = [], [], [], 0
        kernel_index, others, index = [], [], 0
        for g, (st, ln) in enumerate(zip(self.starts, self.lengths)):
            offset += offset % 2
            es, dsts = flats[g].element_size(), self.dsts[g]
            dst_ok = bool(dsts) and all(t.device == device and t.dtype == flats[g].dtype
                                        for t in dsts)
            members = [k for k, (s, n) in enumerate(zip(st, ln))
                       if (s * es) % word == 0 and (n * es) % word == 0
                       and (not dst_ok or dsts[k].data_ptr() % word == 0)]
            base = min((dsts[k] for k in members), key=lambda t: t.data_ptr(),
                       default=None) if dst_ok else None
            chosen = set(members)
            for k in range(len(ln)):  # off the 8-byte grid: the torch path
                if k in chosen:
                    kernel_index.append(index + k)
                else:
                    others.append((index + k, g, k))
            index += len(ln)
            w_st = [st[k] * es // word for k in members]
            w_ln = [ln[k] * es // word for k in members]
            w_dst = [(dsts[k].data_ptr() - base.data_ptr()) // word if base is not None else 0
                     for k in members]
            align = math.gcd(VECTOR_BYTES // word, *w_st, *w_ln, *w_dst)
            if base is not None and base.data_ptr() % VECTOR_BYTES:
                align = 1
            n_blocks = [max(1, -(-n // op.BLOCK)) for n in w_ln]
            blk_tensor = [k for k, nb in enumerate(n_blocks) for _ in range(nb)]
            blk_start = [b * op.BLOCK for nb in n_blocks for b in range(nb)]
            group_off = offset
            for nb in n_blocks:
                seg_first.append(offset)
                seg_count.append(nb)
                offset += nb
            per_group.append((upload(blk_tensor), upload(blk_start), upload(w_st), upload(w_dst),
                              upload(w_ln), base, group_off, len(blk_tensor), align))
        total = offset + offset % 2
        seg_first = seg_first + [f + total for f in seg_first]
        every = kernel_index == list(range(self.num_tensors))
        tables = (per_group, upload(seg_first), upload(seg_count + seg_count), total,
                  None if every else upload(kernel_index), others)
        with self._lock:
            self._device.setdefault(key, tables)
        return self._device[key]

    def _run(self, flats, *, copy: bool, digest: bool) -> tuple[torch.Tensor, torch.Tensor]:
        dev = flats[0].device
        if dev.type == "cuda" and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):  # Triton launches on the current device
                return self._launch(flats, dev, copy=copy, digest=digest)
        return self._launch(flats, dev, copy=copy, digest=digest)

    def _launch(self, flats, dev, *, copy: bool, digest: bool):
        from .kernel import _copy_digest_kernel, _segment_sum_kernel

        per_group, seg_first, seg_count, total, kernel_index, others = self._tables(dev, flats)
        if copy and any(g[5] is None and g[7] for g in per_group):
            raise ValueError("a destination is not 8-byte aligned; copy with kernel=False")
        partial = torch.zeros(2 * total if digest else 2, dtype=torch.int64, device=dev)
        s1, s2, s3 = ref.SHIFTS
        for flat, tab in zip(flats, per_group):
            blk_tensor, blk_start, src_off, dst_off, length, dst_base, off, nb, align = tab
            if not nb:
                continue
            if flat.data_ptr() % VECTOR_BYTES:
                align = 1  # the offsets' alignment only helps from an aligned buffer
            words = op.word_view(flat)
            dst = op.word_view(dst_base.view(-1)) if (copy and dst_base is not None) else words
            expw, ones, high = finite_lanes(flat.dtype) if digest else (0, 0, 0)
            _copy_digest_kernel[(nb,)](
                words, dst, blk_tensor, blk_start, src_off, dst_off, length,
                *((partial[off:], partial[total + off:]) if digest else (partial, partial)),
                DIGEST=digest, COPY=copy, EXPW=expw, ONES=ones, HIGH=high, ALIGN=align,
                GAMMA=ref.GAMMA, KEY=ref.KEY, M1=ref.M1, M2=ref.M2, S1=s1, S2=s2, S3=s3,
                K1=ref.shift_mask(s1), K2=ref.shift_mask(s2), K3=ref.shift_mask(s3),
                BLOCK=op.BLOCK, num_warps=self.num_warps)
        if copy:
            with torch.no_grad():
                for _, g, k in others:  # tensors off the 8-byte grid: torch copies them
                    s, n = self.starts[g][k], self.lengths[g][k]
                    self.dsts[g][k].view(-1).copy_(flats[g][s:s + n])
        if not digest:
            return None
        count = len(seg_count) // 2
        sums = torch.empty(2 * count, dtype=torch.int64, device=dev)
        if count:
            _segment_sum_kernel[(2 * count,)](partial, seg_first, seg_count, sums,
                                              RBLOCK=op.RBLOCK)
        if kernel_index is None:
            return sums[:count], sums[count:]
        digests = torch.zeros(self.num_tensors, dtype=torch.int64, device=dev)
        bad = torch.zeros(self.num_tensors, dtype=torch.int64, device=dev)
        if count:
            digests[kernel_index] = sums[:count]
            bad[kernel_index] = sums[count:]
        for index, g, k in others:
            s, n = self.starts[g][k], self.lengths[g][k]
            src = flats[g][s:s + n]
            digests[index] = ref.digest_tensor_reference(ref.bits_view(src))
            bad[index] = non_finite_count(src)
        return digests, bad


def non_finite_count(t: torch.Tensor) -> torch.Tensor | int:
    """How many values of ``t`` are NaN or inf (a device tensor for floating ``t``, else 0).
    Float8 values are widened first (torch has no ``isfinite`` for them; NaN and inf survive)."""
    if not t.is_floating_point():
        return 0
    if t.element_size() == 1:
        t = t.float()
    return (~torch.isfinite(t)).sum()


def finite_lanes(dtype: torch.dtype) -> tuple[int, int, int]:
    """``(EXPW, ONES, HIGH)`` for the kernel's NaN/inf test on 64-bit words of ``dtype``: the
    exponent mask in every lane, a 1 in every lane, the top bit of every lane (a lane holds a
    NaN/inf iff ``(w & EXPW) ^ EXPW`` has a zero lane, found with the classic
    ``(x - ONES) & ~x & HIGH`` test). ``(0, 0, 0)``: not checked (integer dtypes)."""
    exp = EXPONENT.get(dtype, 0)
    if not exp:
        return 0, 0, 0
    bits = 8 * torch.empty((), dtype=dtype).element_size()
    lanes = 64 // bits
    expw = sum(exp << (bits * i) for i in range(lanes))
    ones = sum(1 << (bits * i) for i in range(lanes))
    high = sum(1 << (bits * i + bits - 1) for i in range(lanes))
    return tuple(ref._signed(v) for v in (expw, ones, high))

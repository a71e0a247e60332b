"""The weight checksum of ``polynya.distributed``, computed fast on the GPU.

``checksum_views(items)`` returns exactly ``polynya.distributed.checksum_named_tensors(items)``
(the value ``TrainingEngine.weight_checksum()`` gives): per tensor the digest
``sum_i bits(x_i) * (i % 8191 + 1)`` in wrapping int64 arithmetic, then the sha256 of the
signature lines.

A ``DigestPlan`` describes where the tensors lie in a few flat 1-D buffers (tensor ``k`` of
group ``g`` is ``flats[g][start:start + n]``); it is built once per weight layout and keeps its
block tables on the device. On CUDA one sync's digests take two Triton launches per flat buffer
and one device -> host transfer: the first kernel reads the weights once (int64 partial sums
per block of ``BLOCK`` elements), the second adds each tensor's partial sums (one program per
tensor, no atomics). Elsewhere the plain torch reference (``tensor_digest``) is used.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ..distributed import combine_signatures, signature_prefix, tensor_digest, tensor_signature

BLOCK = 4096  # elements per program of the digest kernel
RBLOCK = 2048  # partial sums per iteration of the per-tensor sum
_MOD = 8191
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MAX_TENSOR = 2**31 - BLOCK  # the kernels index inside a tensor in int32
KERNEL_ON_CPU = False  # tests: the Triton path for CPU tensors too (TRITON_INTERPRET=1)


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _digest_blocks_kernel(
        x_ptr,
        blk_tensor_ptr,
        blk_start_ptr,
        base_ptr,
        len_ptr,
        out_ptr,
        BLOCK: tl.constexpr,
        MOD: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(blk_tensor_ptr + pid)
        start = tl.load(blk_start_ptr + pid).to(tl.int32)
        base = tl.load(base_ptr + t)
        n = tl.load(len_ptr + t).to(tl.int32)
        offs = start + tl.arange(0, BLOCK)  # int32: tensors are < 2**31 elements (checked)
        mask = offs < n
        v = tl.load(x_ptr + base + offs.to(tl.int64), mask=mask, other=0)
        w = offs % MOD + 1  # int32 modulo by a constant: a multiply and a shift
        tl.store(out_ptr + pid, tl.sum(v.to(tl.int64) * w.to(tl.int64), axis=0))

    @triton.jit
    def _segment_sum_kernel(partial_ptr, first_ptr, count_ptr, out_ptr, RBLOCK: tl.constexpr):
        t = tl.program_id(0)
        first = tl.load(first_ptr + t)
        count = tl.load(count_ptr + t).to(tl.int32)
        acc = tl.zeros([RBLOCK], dtype=tl.int64)
        for i in range(0, count, RBLOCK):
            offs = i + tl.arange(0, RBLOCK)
            acc += tl.load(partial_ptr + first + offs, mask=offs < count, other=0)
        tl.store(out_ptr + t, tl.sum(acc, axis=0))

    return _digest_blocks_kernel, _segment_sum_kernel


@functools.lru_cache(maxsize=1)
def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class DigestPlan:
    """``tensor_digest`` of tensors lying in flat buffers: ``groups[g] = (starts, lengths)``
    (element offsets into ``flats[g]``). Built once per layout; ``digests(flats)`` per sync."""

    def __init__(self, groups: Sequence[tuple[Sequence[int], Sequence[int]]]):
        self.starts = [tuple(int(s) for s in st) for st, _ in groups]
        self.lengths = [tuple(int(n) for n in ln) for _, ln in groups]
        for st, ln in zip(self.starts, self.lengths):
            if len(st) != len(ln) or any(s < 0 for s in st) or any(n < 0 for n in ln):
                raise ValueError("a digest plan needs one non-negative start per tensor length")
        self.num_tensors = sum(len(ln) for ln in self.lengths)
        # elements each flat must hold
        self.extents = [max((s + n for s, n in zip(st, ln)), default=0)
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

    def _kernel_ok(self, flats: Sequence[torch.Tensor]) -> bool:
        if not self.fits_kernel or len(flats) != len(self.starts) or not _have_triton():
            return False
        dev = flats[0].device if flats else None
        return all(
            (f.is_cuda or KERNEL_ON_CPU) and f.device == dev and f.dim() == 1 and f.is_contiguous()
            and f.numel() >= e and f.element_size() in _BITS
            for f, e in zip(flats, self.extents)
        )

    def digest_tensor(self, flats: Sequence[torch.Tensor], *, kernel: bool | None = None
                      ) -> torch.Tensor:
        """The digests as an int64 tensor (on the flats' device on the kernel path: no host
        sync). ``kernel``: force (tests, with ``TRITON_INTERPRET``) or forbid the Triton path."""
        if len(flats) != len(self.starts):
            raise ValueError(f"{len(flats)} flat buffers for a plan of {len(self.starts)}")
        if kernel is None:
            kernel = self._kernel_ok(flats)
        if not kernel:
            return torch.tensor(self._reference(flats), dtype=torch.int64)
        for f, e in zip(flats, self.extents):
            if f.numel() < e:
                raise ValueError(f"a flat buffer of {f.numel()} elements; the plan needs {e}")
        dev = flats[0].device
        if dev.type == "cuda" and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):  # Triton launches on the current device
                return self._launch(flats, dev)
        return self._launch(flats, dev)

    def _launch(self, flats: Sequence[torch.Tensor], dev: torch.device) -> torch.Tensor:
        blocks_kernel, sum_kernel = _kernels()
        per_group, seg_first, seg_count, total = self._tables(dev)
        partial = torch.empty(total, dtype=torch.int64, device=dev)
        for flat, (blk_tensor, blk_start, base, length, off, nb) in zip(flats, per_group):
            if not nb:
                continue
            bits = flat.view(_BITS[flat.element_size()])
            out = partial if off == 0 else partial[off:]
            blocks_kernel[(nb,)](bits, blk_tensor, blk_start, base, length, out,
                                 BLOCK=BLOCK, MOD=_MOD)
        sums = torch.empty(self.num_tensors, dtype=torch.int64, device=dev)
        if self.num_tensors:
            sum_kernel[(self.num_tensors,)](partial, seg_first, seg_count, sums, RBLOCK=RBLOCK)
        return sums

    def digests(self, flats: Sequence[torch.Tensor], *, kernel: bool | None = None) -> list[int]:
        """``tensor_digest`` of every tensor, groups in order (one device -> host transfer)."""
        return self.digest_tensor(flats, kernel=kernel).tolist()

    def _reference(self, flats: Sequence[torch.Tensor]) -> list[int]:
        out = []
        for flat, st, ln, e in zip(flats, self.starts, self.lengths, self.extents):
            flat = flat.reshape(-1)
            if flat.numel() < e:
                raise ValueError(f"a flat buffer of {flat.numel()} elements; the plan needs {e}")
            out += [tensor_digest(flat[s : s + n]) for s, n in zip(st, ln)]
        return out


def checksum_lines(prefixes: Sequence[str], digests: Sequence[int]) -> str:
    """``combine_signatures`` of ``signature_prefix`` lines completed by their digests."""
    return combine_signatures([p + str(d) for p, d in zip(prefixes, digests)])


_PLANS: OrderedDict = OrderedDict()  # (starts, lengths) -> DigestPlan, for ad-hoc callers
_PLANS_LOCK = threading.Lock()


def cached_plan(starts: Sequence[int], lengths: Sequence[int]) -> DigestPlan:
    """A one-group ``DigestPlan``, cached (a model's layout repeats from sync to sync)."""
    key = (tuple(int(s) for s in starts), tuple(int(n) for n in lengths))
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
    plan = DigestPlan([key])
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > 64:
            _PLANS.popitem(last=False)
    return plan


def digests_in_storage(
    flat: torch.Tensor, starts: Sequence[int], lengths: Sequence[int]
) -> list[int]:
    """``tensor_digest`` of the tensors ``flat[s:s+n]`` (``flat`` 1-D, contiguous) with the
    Triton kernels (any device Triton runs on, e.g. CPU under ``TRITON_INTERPRET=1``)."""
    return cached_plan(starts, lengths).digests([flat], kernel=True)


def checksum_views(items: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``checksum_named_tensors(items)``; fast when the tensors are views of a few CUDA storages."""
    items = list(items)
    if not items or not _have_triton() or not all(
        t.is_cuda and t.is_contiguous() and t.numel() < MAX_TENSOR for _, t in items
    ):
        return combine_signatures(tensor_signature(n, t) for n, t in items)
    groups: dict[tuple[int, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, t in items:
        groups.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append((name, t))
    prefixes, digests = [], []
    for members in groups.values():
        first = members[0][1]
        size = first.untyped_storage().nbytes() // first.element_size()
        flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), 0, (size,)
        )
        plan = cached_plan([t.storage_offset() for _, t in members], [t.numel() for _, t in members])
        digests.append(plan.digest_tensor([flat], kernel=True))
        prefixes += [signature_prefix(n, t.dtype, t.shape) for n, t in members]
    return checksum_lines(prefixes, gather(digests))


def gather(digests: Sequence[torch.Tensor]) -> list[int]:
    """``digest_tensor`` results as one list of ints (one device -> host transfer)."""
    if len({d.device for d in digests}) == 1:
        return torch.cat(list(digests)).tolist()
    return [v for d in digests for v in d.tolist()]

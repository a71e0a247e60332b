"""The weight checksum of ``polynya.distributed``, computed fast on the GPU.

``checksum_views(items)`` returns exactly ``polynya.distributed.checksum_named_tensors(items)``
(the value ``TrainingEngine.weight_checksum()`` gives): per tensor the digest
``sum_i bits(x_i) * (i % 8191 + 1)`` in wrapping int64 arithmetic, then the sha256 of the
signature lines. On CUDA the digests of many tensors come from one Triton launch per flat storage
(one read of the weights, int64 accumulation per block, partial sums added per tensor), instead
of several passes and a launch per tensor; elsewhere the plain torch reference is used.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..distributed import combine_signatures, tensor_signature

BLOCK = 4096
_MOD = 8191
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.lru_cache(maxsize=1)
def _kernel():
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

    return _digest_blocks_kernel


def _use_triton(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _block_table(starts: tuple[int, ...], lengths: tuple[int, ...], device: torch.device):
    """Per-block tensor index and start (device tensors), cached: a model's layout repeats."""
    key = (starts, lengths, str(device))
    if key not in _TABLES:
        n_blocks = [max(1, -(-n // BLOCK)) for n in lengths]
        blk_tensor = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(n_blocks))
        blk_start = torch.cat([torch.arange(k, dtype=torch.int64) * BLOCK for k in n_blocks])
        base = torch.tensor(starts, dtype=torch.int64)
        length = torch.tensor(lengths, dtype=torch.int64)
        if len(_TABLES) >= 8:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = tuple(x.to(device) for x in (blk_tensor, blk_start, base, length))
    return _TABLES[key]


_TABLES: dict = {}


def digests_in_storage(
    flat: torch.Tensor, starts: Sequence[int], lengths: Sequence[int]
) -> list[int]:
    """``tensor_digest`` of the tensors ``flat[s:s+n]`` (``flat`` 1-D, contiguous, CUDA) in one launch."""
    bits = flat.view(_BITS[flat.element_size()])
    dev = flat.device
    blk_tensor, blk_start, base, length = _block_table(
        tuple(int(s) for s in starts), tuple(int(n) for n in lengths), dev
    )
    partial = torch.empty(blk_tensor.numel(), dtype=torch.int64, device=dev)
    _kernel()[(blk_tensor.numel(),)](
        bits, blk_tensor, blk_start, base, length, partial, BLOCK=BLOCK, MOD=_MOD
    )
    sums = torch.zeros(len(lengths), dtype=torch.int64, device=dev).index_add_(
        0, blk_tensor, partial
    )
    return sums.tolist()


def checksum_views(items: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``checksum_named_tensors(items)``; fast when the tensors are views of a few CUDA storages."""
    items = list(items)
    if not items or not all(
        _use_triton(t) and t.is_contiguous() and t.numel() < 2**31 - BLOCK for _, t in items
    ):
        return combine_signatures(tensor_signature(n, t) for n, t in items)
    groups: dict[tuple[int, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, t in items:
        groups.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append((name, t))
    lines = []
    for members in groups.values():
        first = members[0][1]
        size = first.untyped_storage().nbytes() // first.element_size()
        flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), 0, (size,)
        )
        digests = digests_in_storage(
            flat, [t.storage_offset() for _, t in members], [t.numel() for _, t in members]
        )
        lines += [f"{n}|{t.dtype}|{tuple(t.shape)}|{d}" for (n, t), d in zip(members, digests)]
    return combine_signatures(lines)

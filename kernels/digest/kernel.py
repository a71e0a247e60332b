"""Triton kernels of the weight digest (``reference.py`` defines it).

Both read a tensor as 64-bit words (its raw bytes, little-endian; the launchers pass an int64
view of the flat buffer and word offsets). ``_digest_blocks_kernel``: one program per block of
``BLOCK`` words of one tensor; mixes each word with its position (SplitMix64 finaliser, int64
arithmetic wrapping like torch's) and writes the block's sum. ``_segment_sum_kernel``: one
program per tensor, adds its blocks' partial sums (no atomics). ``_copy_digest_kernel``: the
same words from one read, optionally copied to a destination and checked for NaN/inf. Sums
wrap modulo ``2**64``, so any block order gives the reference's bits.
"""
import triton
import triton.language as tl


@triton.jit
def _digest_blocks_kernel(x_ptr, blk_tensor_ptr, blk_start_ptr, base_ptr, len_ptr, out_ptr,
                          VMASK: tl.constexpr, GAMMA: tl.constexpr, KEY: tl.constexpr,
                          M1: tl.constexpr, M2: tl.constexpr,
                          S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
                          K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
                          BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(blk_tensor_ptr + pid)
    start = tl.load(blk_start_ptr + pid).to(tl.int32)
    base = tl.load(base_ptr + t)
    n = tl.load(len_ptr + t).to(tl.int32)
    offs = start + tl.arange(0, BLOCK)  # int32: tensors are < 2**31 elements (checked)
    mask = offs < n
    v = tl.load(x_ptr + base + offs.to(tl.int64), mask=mask, other=0).to(tl.int64)
    if VMASK != 0:
        v = v & VMASK  # zero-extend the element's bits
    z = (offs.to(tl.int64) * GAMMA + KEY) ^ v
    z = (z ^ ((z >> S1) & K1)) * M1  # (z >> s) & k: the logical shift of an int64
    z = (z ^ ((z >> S2) & K2)) * M2
    z = z ^ ((z >> S3) & K3)
    z = tl.where(mask, z, 0)
    tl.store(out_ptr + pid, tl.sum(z, axis=0))


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


@triton.jit
def _copy_digest_kernel(src_ptr, dst_ptr, blk_tensor_ptr, blk_start_ptr, src_off_ptr, dst_off_ptr,
                        len_ptr, partial_ptr, bad_ptr,
                        DIGEST: tl.constexpr, COPY: tl.constexpr, EXPW: tl.constexpr,
                        ONES: tl.constexpr, HIGH: tl.constexpr, ALIGN: tl.constexpr,
                        GAMMA: tl.constexpr, KEY: tl.constexpr, M1: tl.constexpr,
                        M2: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
                        K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One program per block of ``BLOCK`` 64-bit words of one tensor of a flat source: one
    read of the block, then (each optional) its copy to ``dst_ptr + dst_off[t]``, its count of
    words holding a NaN/inf (``EXPW``: the exponent mask in every lane, 0 = off; a lane is
    non-finite iff ``(w & EXPW) ^ EXPW`` is zero there, found with ``(x - ONES) & ~x & HIGH``)
    and its digest partial sum (the words of ``_digest_blocks_kernel``). Offsets and lengths
    are multiples of ``ALIGN`` words (checked by the launcher), so loads and stores vectorise."""
    pid = tl.program_id(0)
    t = tl.load(blk_tensor_ptr + pid)
    start = tl.multiple_of(tl.load(blk_start_ptr + pid).to(tl.int32), BLOCK)
    n = tl.multiple_of(tl.load(len_ptr + t).to(tl.int32), ALIGN)
    src_base = tl.multiple_of(tl.load(src_off_ptr + t), ALIGN)
    offs = start + tl.arange(0, BLOCK)  # int32: tensors are < 2**31 words (checked)
    mask = offs < n
    w = tl.load(src_ptr + src_base + offs.to(tl.int64), mask=mask, other=0)
    if COPY:
        dst_base = tl.multiple_of(tl.load(dst_off_ptr + t), ALIGN)
        tl.store(dst_ptr + dst_base + offs.to(tl.int64), w, mask=mask)
    if EXPW != 0:
        x = (w & EXPW) ^ EXPW
        bad = (((x - ONES) & ~x & HIGH) != 0) & mask
        tl.store(bad_ptr + pid, tl.sum(bad.to(tl.int64), axis=0))
    if DIGEST:
        z = (offs.to(tl.int64) * GAMMA + KEY) ^ w
        z = (z ^ ((z >> S1) & K1)) * M1
        z = (z ^ ((z >> S2) & K2)) * M2
        z = z ^ ((z >> S3) & K3)
        z = tl.where(mask, z, 0)
        tl.store(partial_ptr + pid, tl.sum(z, axis=0))

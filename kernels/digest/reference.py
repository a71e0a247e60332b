"""The weight digest in plain torch: the definition, the test oracle and the CPU path.

``digest_reference(bits)`` of a 1-D integer view of a tensor's raw bits (``bits_view``) is

    sum_w  mix64((w * GAMMA + KEY) XOR word[w])        (mod 2**64, as a signed int64)

over the tensor's raw bytes read as little-endian 64-bit words (``word[w]`` holds bytes
``8w .. 8w + 7``: 4 bf16 / fp16, 2 fp32 or 1 fp64 element; the last word zero-padded, which is
unambiguous because the checksum line carries the dtype and shape), with ``mix64`` the
SplitMix64 finaliser (a bijection of 64-bit words). A word is a bijection of the bits of the
elements in it, and every word's mix depends on both its position and its value, so

- a single changed value always changes the digest (its word changes, and the mix of that
  word is a bijection of it);
- swapping two values, moving a value, or a ``+k`` / ``-k`` pair changes it unless two
  unrelated 64-bit mixes happen to cancel (probability about ``2**-64`` per event; inside one
  word it always changes), unlike the earlier ``sum bits * (i % 8191 + 1)``, which accepted a
  swap 8191 apart and every ``+k/-k`` pair at positions of equal weight.

One mix per 8 bytes (not per element): the mix is the digest's whole cost on a GPU (it is
compute-bound: two 64-bit multiplies and three shifts per word), so bf16 weights cost a
quarter of a per-element mix. It is a corruption check, not a MAC: the constants are public,
so someone who can write the weights can also forge a matching digest. The sum is order-free
(blocks can be reduced in any order on the GPU and give the same bits); 64-bit products and
sums wrap modulo ``2**64`` both here and in ``kernel.py``, so both paths agree bit for bit.
"""
from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # words are read with the native byte order below
    raise ImportError("polynya's weight digest assumes a little-endian host")

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK = 1 << 22  # words mixed at a time (bounds the int64 scratch memory)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


GAMMA = _signed(0x9E3779B97F4A7C15)  # SplitMix64's increment (odd: positions never collide)
KEY = _signed(0x243F6A8885A308D3)
M1 = _signed(0xBF58476D1CE4E5B9)
M2 = _signed(0x94D049BB133111EB)
SHIFTS = (30, 27, 31)


def value_mask(element_size: int) -> int:
    """The mask that zero-extends an element of ``element_size`` bytes read as a signed int
    (0: an 8-byte element is used as it is)."""
    return 0 if element_size == 8 else (1 << (8 * element_size)) - 1


def shift_mask(s: int) -> int:
    """``(z >> s) & shift_mask(s)`` is the logical right shift of an int64 ``z``."""
    return (1 << (64 - s)) - 1


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits as a 1-D integer tensor (a view when ``t`` is contiguous)."""
    if t.element_size() not in BITS:
        raise ValueError(f"cannot digest a {t.dtype} tensor ({t.element_size()}-byte elements)")
    return t.detach().contiguous().reshape(-1).view(BITS[t.element_size()])


def mix_words(bits: torch.Tensor, start: int) -> torch.Tensor:
    """The mixed int64 words of positions ``start, start + 1, ...`` (``bits`` a 1-D integer
    chunk: ``words_view`` words for the digest; narrower integers are zero-extended)."""
    v = bits.to(torch.int64, copy=True)  # a fresh buffer: it is reused as scratch below
    mask = value_mask(bits.element_size())
    if mask:
        v &= mask
    z = torch.arange(start, start + bits.numel(), device=bits.device, dtype=torch.int64)
    z.mul_(GAMMA).add_(KEY).bitwise_xor_(v)
    t = v  # scratch (v is no longer needed): every step in place, two int64 buffers in all
    for s, m in zip(SHIFTS, (M1, M2, None)):
        torch.bitwise_right_shift(z, s, out=t)
        z.bitwise_xor_(t.bitwise_and_(shift_mask(s)))  # z ^= logical (z >> s)
        if m is not None:
            z.mul_(m)
    return z


def words_view(bits: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``bits`` (any integer view) as little-endian int64 words: a view when
    they are whole words at an 8-byte aligned offset, else one zero-padded copy."""
    b = bits.contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 8 == 0 and b.storage_offset() % 8 == 0:
        return b.view(torch.int64)
    padded = torch.zeros(-(-b.numel() // 8) * 8, dtype=torch.uint8, device=b.device)
    padded[: b.numel()] = b
    return padded.view(torch.int64)


def digest_tensor_reference(bits: torch.Tensor) -> torch.Tensor:
    """The digest of ``bits`` (a 1-D integer view from ``bits_view``) as a 0-d int64 tensor on
    its device (no host sync)."""
    words = words_view(bits)
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, words.numel(), CHUNK):
        total += mix_words(words[start:start + CHUNK], start).sum()
    return total


def digest_reference(bits: torch.Tensor) -> int:
    """The digest of ``bits`` (a 1-D integer view from ``bits_view``), as a Python int."""
    return int(digest_tensor_reference(bits))


def digest_python(values: list[int], element_size: int) -> int:
    """The same digest with Python integers (an independent oracle for tests): ``values``
    are the elements' bits as ints, laid out little-endian into 64-bit words here."""
    m64 = (1 << 64) - 1
    mask = (1 << (8 * element_size)) - 1
    raw = b"".join((v & mask).to_bytes(element_size, "little") for v in values)
    raw += bytes(-len(raw) % 8)
    total = 0
    for i in range(len(raw) // 8):
        z = ((i * GAMMA + KEY) & m64) ^ int.from_bytes(raw[8 * i:8 * i + 8], "little")
        z = ((z ^ (z >> 30)) * (M1 & m64)) & m64
        z = ((z ^ (z >> 27)) * (M2 & m64)) & m64
        total = (total + (z ^ (z >> 31))) & m64
    return _signed(total)

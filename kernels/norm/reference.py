"""Plain-torch RMSNorm, op for op the math of Hugging Face's Llama/Qwen2/Qwen3/Mistral RMSNorm:
the oracle of the Triton kernels and their CPU path.

``rms_norm_reference(x, weight, eps)`` -> ``weight * (x.float() * rsqrt(mean(x.float()^2, -1) +
eps)).to(x.dtype)``: the normalised row is rounded to the input's dtype *before* the weight
multiplies it, and the product takes ``promote(weight.dtype, x.dtype)`` (bf16 for a bf16 model).
Autograd through these ops gives the reference gradients.
"""
from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``[..., H]``, ``weight`` ``[H]`` -> ``[..., H]`` (the same ops as HF's module)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)

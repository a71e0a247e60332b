"""Plain-torch rotary position embedding, op for op HF's ``apply_rotary_pos_emb`` with
``rotate_half`` (Llama/Qwen2/Qwen3/Mistral): the oracle of the Triton kernel and its CPU path.

``rope_reference(q, k, cos, sin)`` -> ``(q * cos + rotate_half(q) * sin, k * cos +
rotate_half(k) * sin)`` with ``cos``/``sin`` ``[B, T, D]`` broadcast over the heads of ``q``
``[B, Hq, T, D]`` and ``k`` ``[B, Hk, T, D]`` (HF's ``unsqueeze_dim=1``); ``rotate_half(x) =
cat(-x[..., D/2:], x[..., :D/2])``. Autograd through these ops gives the reference gradients.
"""
from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (module docstring)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)

"""Fused rotary position embedding (HF Llama/Qwen2/Qwen3/Mistral ``apply_rotary_pos_emb``) for
training: one Triton launch forward and one backward for ``q`` and ``k`` together (``op.py``);
``reference.py`` is the torch oracle and CPU path::

    from polynya.kernels.rope import rope
    q_embed, k_embed = rope(q, k, cos, sin)   # q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B, T, D]
"""
from .op import RoPEFunction, kernel_applies, rope
from .reference import rope_reference

__all__ = ["RoPEFunction", "kernel_applies", "rope", "rope_reference"]

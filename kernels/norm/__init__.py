"""Fused RMSNorm (HF Llama/Qwen2/Qwen3/Mistral math) for training: one Triton launch forward,
two backward (``op.py``); ``reference.py`` is the torch oracle and CPU path::

    from polynya.kernels.norm import rms_norm
    y = rms_norm(x, weight, eps)          # x [..., H], weight [H]; differentiable in both
"""
from .op import RMSNormFunction, kernel_applies, rms_norm
from .reference import rms_norm_reference

__all__ = ["RMSNormFunction", "kernel_applies", "rms_norm", "rms_norm_reference"]

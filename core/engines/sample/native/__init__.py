"""The native sampling backend: a small, readable paged-KV engine (think nano-vllm).

Request path, one file per room: ``engine`` (requests, steps) → ``scheduler`` (continuous
batching, preemption) → ``block_manager`` (pages, prefix cache, forks, copy-on-write) →
``model_runner`` (HF model over the paged cache) → ``attention`` (the ``AttentionInterface``
function; decode through ``polynya.kernels.fca``) → ``sampler`` (filters and sampling on device).
"""
from .engine import NativeEngine

__all__ = ["NativeEngine"]

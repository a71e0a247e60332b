"""The native sampling backend: a small, readable paged-KV engine (think nano-vllm).

Request path, one file per room: ``engine`` (requests, steps) → ``scheduler`` (continuous
batching, preemption) → ``block_manager`` (pages, prefix cache, forks, copy-on-write) →
``model_runner`` (HF model over the paged cache; ``compiled``: its decode step through
``torch.compile``; ``cuda_graph``: decode steps replayed as CUDA graphs) → ``attention`` (the ``AttentionInterface``
function; decode through ``polynya.kernels.fca``) → ``sampler`` (filters and sampling on device)
→ ``readback`` (a step's tokens back to the host, one async copy). ``decode_inputs`` holds a
decode step's host arrays, which async scheduling builds one step ahead.
"""
from .engine import NativeEngine

__all__ = ["NativeEngine"]

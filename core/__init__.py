"""polynya: compute engines for RL post-training of LLMs.

Public names (see README): ``RolloutBatch``, ``TokenStats``, ``SamplingParams``, ``Sample``,
``compute_logprobs`` and the subpackages ``config``, ``engines``, ``models``, ``kernels``.
The client (``RLClientConfig``, ``create_rl_client``) and the engines load lazily, so importing
polynya never imports DeepSpeed, vLLM, Ray or an RL framework.
"""
from __future__ import annotations

import importlib
import os

from .types import RolloutBatch, Sample, SamplingParams, TokenStats

__version__ = "0.1.0"

# cuDNN builds a plan for every new attention shape (~85 ms fwd + bwd on an H200) and RL brings
# new lengths every step; torch's switch (read once, at the process's first cuDNN attention call,
# hence here) reuses plans across power-of-two length buckets. See polynya.zorro.attention.
os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")

_LAZY = {
    "compute_logprobs": ("polynya.logprobs", "compute_logprobs"),
    "RLClientConfig": ("polynya.client", "RLClientConfig"),
    "create_rl_client": ("polynya.client", "create_rl_client"),
}

__all__ = ["RolloutBatch", "TokenStats", "SamplingParams", "Sample", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'polynya' has no attribute {name!r}")

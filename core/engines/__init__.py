"""The three engines. Each is imported on first use, so ``import polynya.engines`` stays light:

- ``TrainingEngine``  (``polynya.engines.train``,   needs ``polynya[deepspeed]``)
- ``LogProbEngine``   (``polynya.engines.logprob``, needs ``polynya[deepspeed]``)
- ``SamplingEngine``  (``polynya.engines.sample``,  native backend: no extra; vLLM: ``polynya[vllm]``)
"""
from __future__ import annotations

import importlib

_LAZY = {
    "TrainingEngine": "polynya.engines.train",
    "LogProbEngine": "polynya.engines.logprob",
    "SamplingEngine": "polynya.engines.sample",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polynya.engines' has no attribute {name!r}")

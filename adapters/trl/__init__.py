"""TRL adapter (``pip install 'polynya[trl]'``): TRL's GRPO trainer on polynya's engines.

    from polynya.adapters.trl import GRPOTrainer   # a trl.GRPOTrainer; see .trainer

Importing this package does not import TRL; ``GRPOTrainer`` does, and raises ImportError naming
the extra when TRL is missing.
"""
from __future__ import annotations

import importlib

__all__ = ["GRPOTrainer"]


def __getattr__(name: str):
    if name != "GRPOTrainer":
        raise AttributeError(f"module 'polynya.adapters.trl' has no attribute {name!r}")
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        raise ImportError("polynya.adapters.trl.GRPOTrainer needs TRL: pip install 'polynya[trl]'") from exc
    return importlib.import_module(f"{__name__}.trainer").GRPOTrainer

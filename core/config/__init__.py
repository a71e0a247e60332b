"""One config schema: a validated dataclass per engine, re-exported here (the client's
``RLClientConfig`` is ``polynya.RLClientConfig``: the config layer never imports the client).

Each dataclass checks itself in ``__post_init__`` and raises ``ValueError`` naming the bad
field, so a mistake fails before any engine is built. Hydra recipes register these same
classes as structured configs; YAML only overrides their defaults.
"""
from .common import DTYPES, resolve_dtype

__all__ = ["DTYPES", "resolve_dtype"]
from .sampler import SamplerConfig  # noqa: E402

__all__ += ["SamplerConfig"]
from .logprob import LogProbConfig  # noqa: E402
from .train import LossConfig, OptimConfig, TrainConfig  # noqa: E402

__all__ += ["TrainConfig", "OptimConfig", "LossConfig", "LogProbConfig"]

"""SkyRL 0.4 adapter (``pip install 'polynya[skyrl]'``, CPython >= 3.12 as SkyRL needs).

- Inference: SkyRL's HTTP ``RemoteInferenceClient`` works unchanged against
  ``python -m polynya.client.server`` (set ``generator.inference_engine.external_proxy_url`` and
  ``external_server_urls`` to the server's URL; routes: ``polynya.client.ecosystem`` and
  ``polynya.client.routes_skyrl``).
- Training: ``PolicyWorker`` / ``RefWorker`` run SkyRL's ``TrainingInputBatch`` (its padded,
  right-aligned layout and pre-scaled advantages) on polynya's DeepSpeed ``TrainingEngine``
  (ZoRRo) and ``LogProbEngine``; ``batch`` holds the translation, ``loss`` the config mapping.

Importing this package imports neither SkyRL nor DeepSpeed.
"""
from .batch import rollout_from_training_batch, to_right_aligned
from .loss import train_config_from_skyrl

__all__ = [
    "PolicyWorker",
    "RefWorker",
    "rollout_from_training_batch",
    "to_right_aligned",
    "train_config_from_skyrl",
]


def __getattr__(name: str):
    if name in ("PolicyWorker", "RefWorker"):
        from . import worker

        return getattr(worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

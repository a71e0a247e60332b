"""Registers polynya's backends in verl's registries (called by ``plugin`` on ``import verl``).

- ``EngineRegistry``: ``language_model`` / ``deepspeed`` on ``cuda`` and ``cpu`` ->
  ``DeepSpeedLMEngine`` (polynya's DeepSpeed ``TrainingEngine``);
- ``RolloutReplicaRegistry``: ``polynya`` -> ``PolynyaReplica`` (polynya's sampler as a server),
  and the worker-side adapter under ``("polynya", "async")`` in ``_ROLLOUT_REGISTRY`` (verl
  0.9.1 has no function for that table; it is the documented lookup of ``get_rollout_class``);
- ``CheckpointEngineRegistry``: ``polynya`` -> ``PolynyaCheckpointEngine`` (verified sync).

Idempotent: entries already present are left alone.
"""
from __future__ import annotations

ENGINE_BACKEND = "deepspeed"
ROLLOUT_NAME = "polynya"
CHECKPOINT_BACKEND = "polynya"
DEVICES = ("cuda", "cpu")


def _load_replica():
    from .rollout import PolynyaReplica

    return PolynyaReplica


def register_all() -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.workers.engine import EngineRegistry
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from .checkpoint import PolynyaCheckpointEngine
    from .engine import DeepSpeedLMEngine

    have = EngineRegistry._engines.get("language_model", {}).get(ENGINE_BACKEND, {})
    missing = [d for d in DEVICES if d not in have]
    if missing:
        EngineRegistry.register("language_model", ENGINE_BACKEND, device=missing)(DeepSpeedLMEngine)
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    rollout_base._ROLLOUT_REGISTRY.setdefault((ROLLOUT_NAME, "async"),
                                              "polynya.adapters.verl.rollout.PolynyaServerAdapter")
    CheckpointEngineRegistry.register(CHECKPOINT_BACKEND)(PolynyaCheckpointEngine)

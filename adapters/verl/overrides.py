"""The swap: verl config overrides that put polynya's engines into a verl run.

``SWAP`` is what README shows and the recipe writes; ``engine_overrides`` adds the polynya
engine settings a recipe chose. Every line is a plain Hydra override of verl's
``ppo_trainer.yaml`` (tested: composed with verl's own config and validated by verl).
"""
from __future__ import annotations

SWAP = (
    "hydra.searchpath=[pkg://polynya.adapters.verl.config]",
    "model_engine=polynya",
    "actor_rollout_ref.rollout.name=polynya",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=polynya",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
)


def engine_overrides(*, zero_stage: int, zorro: bool, dtype: str) -> list[str]:
    """polynya engine settings under ``actor_rollout_ref.actor.deepspeed``."""
    base = "actor_rollout_ref.actor.deepspeed"
    return [f"{base}.zero_stage={zero_stage}", f"{base}.zorro={str(zorro).lower()}", f"{base}.dtype={dtype}"]

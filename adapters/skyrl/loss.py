"""SkyRL's ``trainer`` config -> polynya's ``TrainConfig`` (one mapping, refusing what differs).

SkyRL's trainer scales the advantages by its ``loss_reduction`` before the worker sees them
(``apply_loss_reduction_to_advantages_minibatch``), and its worker then sums the clipped PPO
surrogate over loss-mask tokens and adds ``kl_loss_coef`` times the per-sequence mean KL
averaged over sequences (``PolicyWorkerBase._forward_backward_micro``). In polynya's terms that
is ``loss="ppo"`` with ``norm="sum"`` and ``kl_norm="sequence"``; the clip range, KL estimator,
temperature and optimizer carry over. What SkyRL computes differently is refused here, by name:
other policy losses, off-policy corrections, the entropy loss (a per-micro-batch token mean in
SkyRL), the ``abs`` KL estimator. Known numeric difference: SkyRL clamps the k3 estimate to
``[-10, 10]`` (and log-ratios to ±20); polynya does not, so the two agree while k3 stays < 10.
"""
from __future__ import annotations

from typing import Any

from polynya.config.train import LossConfig, OptimConfig, TrainConfig


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        obj = obj.get(part, default) if isinstance(obj, dict) else getattr(obj, part, default)
        if obj is None:
            return default
    return obj


def loss_config_from_skyrl(algorithm: Any) -> tuple[LossConfig, float]:
    """``(LossConfig, temperature)`` for SkyRL's ``trainer.algorithm`` (dataclass or dict)."""
    kind = _get(algorithm, "policy_loss_type", "regular")
    if kind != "regular":
        raise ValueError(f"trainer.algorithm.policy_loss_type={kind!r} is not supported by the "
                         "polynya worker; use 'regular' (clipped PPO)")
    opc = _get(algorithm, "off_policy_correction", {})
    for key in ("tis_ratio_type", "sequence_mask_metric", "outlier_token_is_threshold_low",
                "outlier_token_is_threshold_high", "token_mask_is_threshold_low",
                "token_mask_is_threshold_high"):
        if _get(opc, key) is not None:
            raise ValueError(f"trainer.algorithm.off_policy_correction.{key} is not supported by "
                             "the polynya worker; leave it null")
    if _get(algorithm, "use_entropy_loss", False):
        raise ValueError("trainer.algorithm.use_entropy_loss=true is not supported by the polynya "
                         "worker (SkyRL averages it per micro-batch); set it to false")
    use_kl = bool(_get(algorithm, "use_kl_loss", True))
    estimator = _get(algorithm, "kl_estimator_type", "k3")
    if use_kl and estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"trainer.algorithm.kl_estimator_type={estimator!r} is not supported; "
                         "use k1, k2 or k3")
    loss = LossConfig(clip_low=float(_get(algorithm, "eps_clip_low", 0.2)),
                      clip_high=float(_get(algorithm, "eps_clip_high", 0.2)),
                      norm="sum", kl_norm="sequence",
                      kl_coef=float(_get(algorithm, "kl_loss_coef", 0.001)) if use_kl else 0.0,
                      kl_estimator=estimator if use_kl else "k3")
    return loss, float(_get(algorithm, "temperature", 1.0) or 1.0)


def train_config_from_skyrl(trainer: Any, model: str, **engine: Any) -> TrainConfig:
    """polynya's ``TrainConfig`` for SkyRL's ``cfg.trainer`` (policy optimizer + algorithm).

    Args:
        trainer: SkyRL's ``cfg.trainer`` (``TrainerConfig`` or a dict of the same shape).
        model: polynya model spec / HF id / path (SkyRL's ``trainer.policy.model.path``).
        engine: further ``TrainConfig`` fields (``dtype``, ``zero_stage``, ``zorro``, ...).
    """
    loss, temperature = loss_config_from_skyrl(_get(trainer, "algorithm", {}))
    opt = _get(trainer, "policy.optimizer_config", {})
    schedule = _get(opt, "scheduler", "constant_with_warmup")
    if schedule not in ("constant", "constant_with_warmup"):
        raise ValueError(f"trainer.policy.optimizer_config.scheduler={schedule!r} is not supported "
                         "by the polynya worker; use constant_with_warmup")
    betas = _get(opt, "adam_betas", [0.9, 0.999])
    optim = OptimConfig(betas=(float(betas[0]), float(betas[1])),
                        weight_decay=float(_get(opt, "weight_decay", 1e-2)),
                        grad_clip=float(_get(opt, "max_grad_norm", 1.0)),
                        warmup_steps=int(_get(opt, "num_warmup_steps", 0)), schedule="constant")
    return TrainConfig(model, lr=float(_get(opt, "lr", 1e-6)), loss="ppo", loss_config=loss,
                       optim=optim, temperature=temperature, **engine)

"""SkyRL's ``trainer`` config -> polynya's ``TrainConfig`` (one mapping, refusing what differs).

Loss. SkyRL's trainer scales the advantages by its ``loss_reduction`` before the worker sees them
(``apply_loss_reduction_to_advantages_minibatch``), and its worker then sums the clipped PPO
surrogate over loss-mask tokens and adds ``kl_loss_coef`` times the per-sequence mean KL
averaged over sequences (``PolicyWorkerBase._forward_backward_micro``). In polynya's terms that
is ``loss="ppo"`` with ``norm="sum"`` and ``kl_norm="sequence"``; the clip range, KL estimator,
temperature and optimizer carry over, and so do SkyRL's clamps (``ppo_policy_loss``: the
log-ratio to ±20 before ``exp``, ``safe_exp_delta``; ``compute_approx_kl``: the k3 estimate to
±10; its k1 / k2 are unclamped, as polynya's): ``log_ratio_clip=20``, ``kl_clip=10`` with k3.
What SkyRL computes differently is refused here, by name: other policy losses (``dual_clip``
included), off-policy corrections (also the deprecated ``use_tis``), sample-support replay, the
entropy loss (a per-micro-batch token mean in SkyRL), the ``abs`` KL estimator, an unset
temperature (SkyRL's worker refuses it too), LoRA, MTP draft heads, fake-INT4 QAT and
``model_config_kwargs``.

Learning rate. SkyRL builds its schedule with transformers' ``get_scheduler(scheduler,
num_warmup_steps, num_training_steps)`` and steps it once per optimizer step, as polynya does;
the mapped schedules give the same rate at every step:

- ``constant``: ``lr`` from step 0 (transformers ignores ``num_warmup_steps`` for it);
- ``constant_with_warmup``, ``cosine``, ``cosine_with_restarts``: only with
  ``num_warmup_steps=0``. transformers warms up as ``step / N`` (0 at step 0) and polynya as
  ``(step + 1) / (N + 1)``, so a warm-up is refused, not approximated. The cosines need
  ``num_training_steps`` (the length SkyRL gives its scheduler) and become polynya's
  ``warmup_cosine`` down to 0; ``cosine`` matches up to that length (SkyRL stops there; past it
  transformers' cosine would rise again, polynya's stays at 0), ``cosine_with_restarts`` (one
  cycle) at every step;
- the other names (``linear``, ``polynomial``, ``inverse_sqrt``, ...) are refused.
"""
from __future__ import annotations

from typing import Any

from polynya.config.train import LossConfig, OptimConfig, TrainConfig

_OPT = "trainer.policy.optimizer_config"
SKYRL_LOG_RATIO_CLIP = 20.0  # skyrl 0.4.0 ppo_policy_loss: safe_exp_delta(log_probs - old_log_probs, clip=20.0)
SKYRL_K3_CLIP = 10.0  # skyrl 0.4.0 compute_approx_kl: k3 clamped to [-10, 10]
_SCHEDULERS = ("constant", "constant_with_warmup", "cosine", "cosine_with_restarts")


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        obj = obj.get(part, default) if isinstance(obj, dict) else getattr(obj, part, default)
        if obj is None:
            return default
    return obj


def _check_count(value: Any, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


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
    if _get(algorithm, "use_tis", False):
        raise ValueError("trainer.algorithm.use_tis=true (deprecated truncated importance sampling; "
                         "SkyRL's validate_cfg turns it into off_policy_correction.tis_ratio_type="
                         "'token' capped at trainer.algorithm.tis_imp_ratio_cap) is not supported by "
                         "the polynya worker; set use_tis=false")
    if _get(algorithm, "enable_sample_support_replay", False):
        raise ValueError("trainer.algorithm.enable_sample_support_replay=true (log-probs renormalised "
                         "over the sampler's support) is not supported by the polynya worker; set it "
                         "to false")
    if _get(algorithm, "use_entropy_loss", False):
        raise ValueError("trainer.algorithm.use_entropy_loss=true is not supported by the polynya "
                         "worker (SkyRL averages it per micro-batch); set it to false")
    use_kl = bool(_get(algorithm, "use_kl_loss", True))
    estimator = _get(algorithm, "kl_estimator_type", "k3")
    if use_kl and estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"trainer.algorithm.kl_estimator_type={estimator!r} is not supported; "
                         "use k1, k2 or k3")
    temperature = _get(algorithm, "temperature")
    if temperature is None:
        raise ValueError("trainer.algorithm.temperature is unset: set it to the sampling temperature "
                         "(SkyRL's validate_cfg copies generator.sampling_params.temperature; its "
                         "worker refuses None as well)")
    loss = LossConfig(clip_low=float(_get(algorithm, "eps_clip_low", 0.2)),
                      clip_high=float(_get(algorithm, "eps_clip_high", 0.2)),
                      norm="sum", kl_norm="sequence",
                      kl_coef=float(_get(algorithm, "kl_loss_coef", 0.001)) if use_kl else 0.0,
                      kl_estimator=estimator if use_kl else "k3",
                      log_ratio_clip=SKYRL_LOG_RATIO_CLIP,
                      kl_clip=SKYRL_K3_CLIP if use_kl and estimator == "k3" else None)
    return loss, float(temperature)


def optim_config_from_skyrl(opt: Any, num_training_steps: int | None = None) -> tuple[float, OptimConfig]:
    """``(lr, OptimConfig)`` for SkyRL's ``trainer.policy.optimizer_config`` (module docstring).

    Args:
        opt: SkyRL's ``OptimizerConfig`` (or a dict of the same shape).
        num_training_steps: optimizer steps SkyRL's scheduler spans (its trainer passes
            ``total_training_steps * train_batch_size // policy_mini_batch_size *
            update_epochs_per_batch``); needed by the cosine schedules only.
    """
    name = _get(opt, "scheduler", "constant_with_warmup")
    warmup = _check_count(_get(opt, "num_warmup_steps", 0), f"{_OPT}.num_warmup_steps", 0)
    if num_training_steps is not None:
        _check_count(num_training_steps, "num_training_steps", 1)
    if name not in _SCHEDULERS:
        raise ValueError(f"{_OPT}.scheduler={name!r} is not supported by the polynya worker; use one "
                         f"of {_SCHEDULERS} (those polynya's schedule reproduces step for step)")
    schedule: dict[str, Any] = {"schedule": "constant"}  # "constant" ignores num_warmup_steps
    if name != "constant" and warmup > 0:
        raise ValueError(f"{_OPT}.num_warmup_steps={warmup} with scheduler={name!r} is not supported "
                         "by the polynya worker: SkyRL's warm-up (transformers') rises as step/N from "
                         "0, polynya's as (step+1)/(N+1), so every warm-up step would get another "
                         "rate; set num_warmup_steps=0")
    if name in ("cosine", "cosine_with_restarts"):
        if num_training_steps is None:
            raise ValueError(f"{_OPT}.scheduler={name!r} needs train_config_from_skyrl(..., "
                             "num_training_steps=N): the optimizer steps SkyRL's scheduler spans")
        schedule = {"schedule": "warmup_cosine", "total_steps": num_training_steps}
    betas = _get(opt, "adam_betas", [0.9, 0.999])
    return float(_get(opt, "lr", 1e-6)), OptimConfig(
        betas=(float(betas[0]), float(betas[1])), weight_decay=float(_get(opt, "weight_decay", 1e-2)),
        grad_clip=float(_get(opt, "max_grad_norm", 1.0)), **schedule)


def _refuse_model_changes(trainer: Any) -> None:
    """``ValueError`` for policy-model settings that change SkyRL's training numbers and that
    polynya's full-weight DeepSpeed engine does not reproduce."""
    rank = _get(trainer, "policy.model.lora.rank", 0)
    if rank and rank > 0:
        raise ValueError(f"trainer.policy.model.lora.rank={rank} (LoRA) is not supported by the "
                         "polynya worker, which trains every weight (at a LoRA-sized lr that is "
                         "another run); set it to 0")
    if _get(trainer, "policy.model.fake_int4_qat.enabled", False):
        raise ValueError("trainer.policy.model.fake_int4_qat.enabled=true is not supported by the "
                         "polynya worker; set it to false")
    if _get(trainer, "policy.model_config_kwargs", {}):
        raise ValueError(f"trainer.policy.model_config_kwargs="
                         f"{dict(_get(trainer, 'policy.model_config_kwargs'))!r} is not supported by "
                         "the polynya worker (it loads the model's own config); leave it empty")
    if _get(trainer, "mtp.enabled", False):
        raise ValueError("trainer.mtp.enabled=true (MTP draft-head loss) is not supported by the "
                         "polynya worker; set it to false")


def train_config_from_skyrl(trainer: Any, model: str, *, num_training_steps: int | None = None,
                            **engine: Any) -> TrainConfig:
    """polynya's ``TrainConfig`` for SkyRL's ``cfg.trainer`` (policy optimizer + algorithm).

    Args:
        trainer: SkyRL's ``cfg.trainer`` (``TrainerConfig`` or a dict of the same shape).
        model: polynya model spec / HF id / path (SkyRL's ``trainer.policy.model.path``).
        num_training_steps: the length of SkyRL's LR schedule in optimizer steps (needed by
            ``scheduler="cosine"`` / ``"cosine_with_restarts"``; see ``optim_config_from_skyrl``).
        engine: further ``TrainConfig`` fields (``dtype``, ``zero_stage``, ``zorro``, ...).
    Raises:
        ValueError: a SkyRL setting polynya does not compute the same way, named by its key.
    """
    _refuse_model_changes(trainer)
    loss, temperature = loss_config_from_skyrl(_get(trainer, "algorithm", {}))
    lr, optim = optim_config_from_skyrl(_get(trainer, "policy.optimizer_config", {}), num_training_steps)
    return TrainConfig(model, lr=lr, loss="ppo", loss_config=loss, optim=optim,
                       temperature=temperature, **engine)

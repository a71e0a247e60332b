"""verl-side config classes of polynya's backends, and their translation to polynya configs.

verl builds every engine from dataclasses named by ``_target_`` in its YAML and checks each
backend's strategy name, so polynya's DeepSpeed backend brings its own:

- ``DeepSpeedEngineConfig`` (``strategy: deepspeed``) — verl's ``EngineConfig`` plus the knobs
  verl has no word for: ``zero_stage``, ``zorro``, ``zorro_attention``, ``compile_layers`` and
  raw ``deepspeed`` overrides. They are the fields of the same name of ``polynya.config.TrainConfig`` and are
  validated by it (one schema, not a copy).
- ``DeepSpeedActorConfig`` — verl's ``ActorConfig`` with that engine under ``deepspeed``.
  verl's own ``ppo_loss`` computes the loss on polynya's log-probs, once per polynya
  micro-batch (whole prompt groups, not verl's partition); that sums to verl's number for
  losses normalised by global counts, so the policy losses that read statistics of their
  micro-batch (``clip_cov``, ``kl_cov``, ``geo_mean``, ``bypass_mode`` with batch-normalised IS
  weights), unchecked custom ones and ``calculate_sum_pi_squared`` are refused here, and
  top-k distillation at the engine's first batch (``check_loss_function``).

``train_config(model_config, engine_config, optimizer_config)`` is the only translation: verl's
model path, dtype, seed, optimizer (verl's ``FSDPOptimizerConfig``: AdamW, constant rate)
and token budget become one ``TrainConfig``. Settings polynya cannot honour (another optimizer,
a warm-up or cosine schedule, ``clip_grad <= 0``, fp16, LoRA, fixed-size micro-batches) raise
``ValueError`` naming the verl key to change; so does a ``checkpoint.save_contents`` or
``load_contents`` without all of ``model``, ``optimizer`` and ``extra`` or with a name verl does
not know (``check_checkpoint``: polynya's engine saves and restores them together; ``hf_model``
may be added). ``TrainConfig.export_hf`` is off: ``hf_model`` is the switch verl users have, and
the engine writes that export where verl does (``engine``).

The model config: verl builds its engines from ``actor_rollout_ref.model.hf_config_path``'s
config with ``model.override_config`` applied; polynya's engines (actor and reference alike)
load the model directory's own ``config.json`` and have no hook for changed values. So an
override that changes the model's config, or an ``hf_config_path`` whose config differs from
the model's, is refused with the keys it changes (copy the model directory with the changed
``config.json`` and point ``model.path`` at it). Overrides equal to the model's own values pass,
and so do ``attn_implementation`` (polynya picks its attention kernels itself:
``deepspeed.zorro_attention``) and the special token ids (verl sets them from the tokenizer;
they change no log-prob or gradient).
"""
from __future__ import annotations

from . import _module_done

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polynya.config.train import OptimConfig, TrainConfig
from verl.workers.config import ActorConfig, EngineConfig

STRATEGY = "deepspeed"
_VERL_MODEL = "<verl actor_rollout_ref.model.path>"  # stands in for the path while validating
# model.override_config keys that leave the engine's numbers unchanged (module docstring)
_NEUTRAL_OVERRIDES = frozenset({"attn_implementation", "bos_token_id", "eos_token_id", "pad_token_id"})
_MISSING = object()


@dataclass
class DeepSpeedEngineConfig(EngineConfig):
    """verl engine config of the ``deepspeed`` strategy (polynya's ``TrainingEngine``).

    Args:
        zero_stage, zorro, zorro_attention, compile_layers, deepspeed: as
            ``polynya.config.TrainConfig``.
        The inherited fields keep verl's meaning (``dtype``, ``seed``, ``param_offload`` ...).
    """

    strategy: str = STRATEGY
    zero_stage: int = 2
    zorro: bool = True
    zorro_attention: str = "auto"
    compile_layers: bool = False
    deepspeed: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != STRATEGY:
            raise ValueError(f"DeepSpeedEngineConfig.strategy must be {STRATEGY!r}, got {self.strategy!r}")
        if self.param_offload != self.optimizer_offload:
            raise ValueError("polynya's deepspeed engine offloads weights and optimizer state together: "
                             "set param_offload and optimizer_offload to the same value")
        TrainConfig(_VERL_MODEL, **self.polynya_fields())  # polynya's own checks, ValueError

    def polynya_fields(self) -> dict[str, Any]:
        """The ``TrainConfig`` fields this config sets directly."""
        return dict(dtype=self.dtype, seed=self.seed, zero_stage=self.zero_stage, zorro=self.zorro,
                    zorro_attention=self.zorro_attention, compile_layers=self.compile_layers,
                    deepspeed=dict(self.deepspeed))


@dataclass
class DeepSpeedActorConfig(ActorConfig):
    """verl actor (and reference) config with ``strategy: deepspeed``; engine under ``deepspeed``."""

    strategy: str = STRATEGY
    deepspeed: DeepSpeedEngineConfig = field(default_factory=DeepSpeedEngineConfig)
    use_remove_padding: bool = True
    use_rollout_log_probs: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != STRATEGY:
            raise ValueError(f"DeepSpeedActorConfig.strategy must be {STRATEGY!r}, got {self.strategy!r}")
        _check_loss(self)
        if not _field(self.deepspeed, "forward_only", False):
            check_checkpoint(self.checkpoint)
        self.engine = self.deepspeed


# verl 0.9.1 policy losses whose value summed over micro-batches does not depend on how a
# mini-batch is cut into micro-batches: per-token or per-sequence terms aggregated by agg_loss
# with the global token / sequence counts. polynya cuts micro-batches of whole prompt groups by
# tokens, verl's engines by its own dynamic-batch partition; only these give the same numbers.
_SPLIT_INVARIANT_LOSSES = ("vanilla", "gspo", "sapo", "gpg", "dppo_tv", "dppo_kl", "dro", "cispo",
                           "bypass_mode")
# ... and those whose value depends on the micro-batch (verl 0.9.1, core_algos.py)
_PER_MICRO_BATCH_LOSSES = {
    "clip_cov": "its covariance, the tokens it picks (torch.randperm) and their count are per micro-batch",
    "kl_cov": "its covariance and its top-k token selection are per micro-batch",
    "geo_mean": "it averages over the micro-batch's sequences (torch.mean), ignoring loss_agg_mode",
}


def _field(config, name: str, default):
    """``config.name`` of a verl config dataclass or of a plain mapping (``default`` if absent)."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _check_loss(actor: ActorConfig) -> None:
    """Refuse the actor loss settings polynya's engine would compute differently from verl's own
    engines (``ValueError`` naming the key); verl's ``ppo_loss`` computes the others itself."""
    key = "actor_rollout_ref.actor"
    policy_loss = actor.policy_loss
    mode = _field(policy_loss, "loss_mode", "vanilla")
    if mode in _PER_MICRO_BATCH_LOSSES:
        raise ValueError(f"{key}.policy_loss.loss_mode={mode!r} is not supported by polynya's deepspeed engine: "
                         f"{_PER_MICRO_BATCH_LOSSES[mode]}, and polynya's micro-batches (whole prompt groups) "
                         "are not verl's, so the gradient would differ from verl's own engines. Use one of "
                         f"{_SPLIT_INVARIANT_LOSSES}")
    if mode not in _SPLIT_INVARIANT_LOSSES:
        raise ValueError(f"{key}.policy_loss.loss_mode={mode!r} has not been checked against polynya's "
                         "micro-batching (a loss that reads statistics of its micro-batch would give other "
                         f"numbers than verl's own engines); supported: {_SPLIT_INVARIANT_LOSSES}")
    correction = _field(policy_loss, "rollout_correction", None)
    if mode == "bypass_mode" and _field(correction, "rollout_is_batch_normalize", False):
        raise ValueError(f"{key}.policy_loss.rollout_correction.rollout_is_batch_normalize=true with "
                         "loss_mode='bypass_mode' is not supported by polynya's deepspeed engine: verl "
                         "normalises the IS weights per micro-batch (with a collective inside the loss), and "
                         "polynya's micro-batches are not verl's; set it to false")
    if getattr(actor, "calculate_sum_pi_squared", False):
        raise ValueError(f"{key}.calculate_sum_pi_squared=true is not supported by polynya's deepspeed engine "
                         "(it returns log-probs and entropy only); set it to false")


def check_loss_function(loss_function) -> None:
    """Refuse, before the engine's first forward, a verl loss function polynya's engine cannot
    feed: verl's distillation (``distillation.enabled``: ``distillation_ppo_loss``) with a top-k
    loss (``forward_kl_topk`` reads the student's full logits inside the forward, through a logits
    processor of verl's own engines; polynya's LM head returns log-probs and entropy only). The
    estimator losses (``k1``, ``k3``, ``low_var_kl`` ...) take the student's log-probs and pass
    (verl 0.9.1 allows only the ``vanilla`` policy loss with them)."""
    config = getattr(loss_function, "keywords", None) or {}
    distill = config.get("distillation_config")
    if distill is None:
        return
    from verl.trainer.distillation.losses import get_distillation_loss_settings

    loss = distill.distillation_loss
    mode = _field(loss, "loss_mode", "k3")
    if get_distillation_loss_settings(mode).use_topk:
        raise ValueError(f"distillation.distillation_loss.loss_mode={mode!r} is not supported by polynya's "
                         "deepspeed engine: verl computes top-k distillation from the student's full "
                         "logits inside the forward, which polynya's LM head never materialises; use an "
                         "estimator loss_mode (k1, k3, low_var_kl, ...)")


# what polynya's TrainingEngine.save writes and load restores, all together: weights, AdamW state,
# LR schedule and step count (verl's "model", "optimizer", "extra")
_CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")
_HF_MODEL = "hf_model"  # save_contents only: a Hugging Face export beside the checkpoint


def check_checkpoint(checkpoint) -> tuple[str, ...]:
    """Refuse ``checkpoint.save_contents`` / ``load_contents`` polynya's engine cannot honour and
    return the save contents. Both must hold all of ``model``, ``optimizer`` and ``extra``: polynya
    saves and restores them together, where verl's engines would write or resume only those listed
    (e.g. resume with a fresh optimizer); ``hf_model`` may be added (saved as verl does; on load
    the checkpoint's own weights are the same ones); other names are refused (verl would ignore a
    misspelt one). ``None`` (or no checkpoint config) means the three, as verl's checkpoint
    managers read it. ``ValueError`` naming the key."""
    key = "actor_rollout_ref.actor.checkpoint"
    known = _CHECKPOINT_CONTENTS + (_HF_MODEL,)
    for name, what in (("load_contents", ("restores weights, optimizer state and LR schedule together on resume, "
                                          "where verl's engines would restore only those listed")),
                       ("save_contents", ("writes weights, optimizer state and LR schedule together, where "
                                          "verl's engines would write only those listed"))):
        listed = _field(checkpoint, name, None)
        if listed is None:
            continue
        unknown = [c for c in listed if c not in known]
        if unknown:
            raise ValueError(f"{key}.{name}={list(listed)!r}: {unknown} unknown (verl's contents are {list(known)})")
        missing = [c for c in _CHECKPOINT_CONTENTS if c not in listed]
        if missing:
            raise ValueError(f"{key}.{name}={list(listed)!r} leaves out {missing}: polynya's deepspeed engine {what}. "
                             f"Include {list(_CHECKPOINT_CONTENTS)} (load_contents follows save_contents unless set)")
    save = _field(checkpoint, "save_contents", None)
    return _CHECKPOINT_CONTENTS if save is None else tuple(save)


def _optim(opt) -> tuple[float, OptimConfig]:
    name = str(getattr(opt, "optimizer", "AdamW")).lower()
    if name != "adamw" or getattr(opt, "optimizer_impl", "torch.optim") != "torch.optim":
        raise ValueError(f"polynya's deepspeed engine trains with torch.optim.AdamW; set "
                         f"actor_rollout_ref.actor.optim.optimizer=AdamW (got {opt.optimizer!r})")
    extra = dict(getattr(opt, "override_optimizer_config", None) or {})  # verl passes it to AdamW(...)
    eps = float(extra.pop("eps", 1e-8))
    fused = extra.pop("fused", None)  # AdamW's own switch; polynya's default: fused on CUDA
    if fused is not None and not isinstance(fused, bool):
        raise ValueError(f"actor.optim.override_optimizer_config.fused must be true or false "
                         f"(or absent: fused on CUDA), got {fused!r}")
    if extra:
        raise ValueError(f"actor.optim.override_optimizer_config keys {sorted(extra)} are not supported by "
                         "polynya's engine (only eps and fused)")
    # polynya's schedule advances per optimizer step (mini-batch), verl's per training step; they
    # only agree for a constant rate without warm-up, so anything else is refused, not guessed.
    warmup = opt.lr_warmup_steps if opt.lr_warmup_steps is not None and opt.lr_warmup_steps >= 0 else 0
    kind = getattr(opt, "lr_scheduler_type", "constant")
    if kind != "constant" or warmup > 0 or opt.lr_warmup_steps_ratio > 0:
        raise ValueError("polynya's deepspeed engine supports actor.optim.lr_scheduler_type=constant "
                         "without warm-up (lr_warmup_steps<=0, lr_warmup_steps_ratio=0) for now")
    clip = opt.clip_grad
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
        # polynya's grad_clip=0 turns clipping off; verl's FSDP engine clips to 0 (every gradient
        # zeroed, AdamW still moves the weights by its momentum and weight decay)
        raise ValueError(f"actor_rollout_ref.actor.optim.clip_grad must be > 0, got {clip!r}: verl's FSDP engine "
                         "clips the gradient norm to it (0 zeroes every gradient), polynya's deepspeed engine "
                         "would not clip at all; for no clipping in effect set a large value (e.g. 1e9)")
    return float(opt.lr), OptimConfig(betas=tuple(opt.betas), eps=eps, weight_decay=float(opt.weight_decay),
                                      grad_clip=float(clip), fused=fused)


def _changes(current, wanted: Mapping, prefix: str = "") -> list[str]:
    """``key=value`` of every entry of ``wanted`` (nested mappings: sub-configs / dicts) that
    differs from ``current`` or is absent from it."""
    changed = []
    for key, value in wanted.items():
        have = current.get(key, _MISSING) if isinstance(current, Mapping) else getattr(current, key, _MISSING)
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and have is not _MISSING and not isinstance(have, (str, int, float)):
            changed += _changes(have, value, name + ".")
        elif have is _MISSING or have != value:
            changed.append(f"{name}={value!r} (the model's: {'absent' if have is _MISSING else repr(have)})")
    return changed


def _check_model_config(model_config, path: str) -> None:
    """Refuse ``model.override_config`` / ``model.hf_config_path`` settings that would change the
    config of the model at ``path`` (module docstring): ``ValueError`` naming the keys."""
    from polynya.models import model_config as load_config

    overrides = dict(getattr(model_config, "override_config", None) or {})
    overrides = dict(overrides.get("model_config", overrides))  # verl reads this nesting too
    overrides = {k: v for k, v in overrides.items() if k not in _NEUTRAL_OVERRIDES}
    config_path = getattr(model_config, "local_hf_config_path", None) or getattr(model_config, "hf_config_path", None)
    other_config = config_path is not None and os.path.realpath(str(config_path)) != os.path.realpath(path)
    if not overrides and not other_config:
        return
    own = load_config(path)
    if other_config:
        mine, theirs = own.to_dict(), load_config(str(config_path)).to_dict()
        skip = _NEUTRAL_OVERRIDES | {"_name_or_path", "transformers_version"}
        changed = [f"{k}={theirs.get(k, 'absent')!r} (the model's: {mine.get(k, 'absent')!r})"
                   for k in sorted(mine.keys() | theirs.keys())
                   if k not in skip and mine.get(k, _MISSING) != theirs.get(k, _MISSING)]
        if changed:
            raise ValueError(f"actor_rollout_ref.model.hf_config_path={config_path!r} holds another config than "
                             f"the model's ({'; '.join(changed)}): polynya's deepspeed engine loads the config.json "
                             "of actor_rollout_ref.model.path. Put that config into a copy of the model directory "
                             "and point model.path at it, or drop hf_config_path")
    changed = _changes(own, overrides)
    if changed:
        raise ValueError(f"actor_rollout_ref.model.override_config changes the model's config ({'; '.join(changed)}): "
                         "polynya's deepspeed engine loads the model's own config.json and cannot apply it. "
                         "Write these values into the config.json of a copy of the model directory and point "
                         "actor_rollout_ref.model.path at it, or drop the override")


def train_config(model_config, engine_config: DeepSpeedEngineConfig, optimizer_config) -> TrainConfig:
    """The ``TrainConfig`` of one verl engine (actor or, with ``forward_only``, reference)."""
    if not isinstance(engine_config, DeepSpeedEngineConfig):
        raise ValueError(f"the deepspeed backend needs a DeepSpeedEngineConfig, got "
                         f"{type(engine_config).__name__}")
    if getattr(model_config, "lora_rank", 0) or getattr(model_config, "lora_adapter_path", None):
        raise ValueError("polynya's deepspeed engine trains full weights: LoRA "
                         "(actor_rollout_ref.model.lora_rank) is not supported")
    path = getattr(model_config, "local_path", None) or model_config.path
    _check_model_config(model_config, str(path))
    budget = engine_config.max_token_len_per_gpu or engine_config.infer_max_token_len_per_gpu
    if not engine_config.use_dynamic_bsz or not budget:
        raise ValueError("polynya's deepspeed engine needs use_dynamic_bsz=true and a token budget "
                         "(actor.ppo_max_token_len_per_gpu / rollout.log_prob_max_token_len_per_gpu)")
    lr, optim = (0.0, OptimConfig()) if optimizer_config is None else _optim(optimizer_config)
    return TrainConfig(str(path), lr=lr, optim=optim, micro_batch_tokens=int(budget), export_hf=False,
                       gradient_checkpointing=bool(getattr(model_config, "enable_gradient_checkpointing",
                                                           False)),
                       **engine_config.polynya_fields())


_module_done()  # verl imported first by this module? finish the plugin's registration

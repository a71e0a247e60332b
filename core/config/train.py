"""``TrainConfig``: how to build a training engine (``polynya.engines.TrainingEngine``).

Three dataclasses, nested so Hydra can register them as one structured config::

    cfg = TrainConfig("tiny:qwen3", dtype="float32", zero_stage=3, lr=1e-5, loss="dapo",
                      optim=OptimConfig(schedule="warmup_cosine", warmup_steps=10, total_steps=200),
                      loss_config=LossConfig(kl_coef=0.01, kl_estimator="k3"))

``OptimConfig`` holds the AdamW and LR-schedule settings (``lr`` itself sits on ``TrainConfig``),
``LossConfig`` the knobs of the loss named by ``TrainConfig.loss`` (``polynya.losses``). Every
field is checked in ``__post_init__``; a mistake raises ``ValueError`` naming the field before
any model or process group is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .common import (check_model_spec, check_naive_layout, check_positive, check_temperature,
                     check_zorro_attention, resolve_dtype)

LOSSES = ("ppo", "grpo", "dapo", "dr_grpo", "gspo")
KL_ESTIMATORS = ("k1", "k2", "k3")
NORMS = ("token", "sequence", "constant", "sum")
SCHEDULES = ("constant", "warmup_cosine")
ENGINE_DTYPES = ("bfloat16", "float32")  # fp16 needs loss scaling and does not run on CPU


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_seed(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")


def check_zero_stage(stage: object, owner: str, allowed: tuple[int, ...] = (0, 1, 2, 3)) -> None:
    if isinstance(stage, bool) or stage not in allowed:
        raise ValueError(f"{owner}.zero_stage must be one of {allowed}, got {stage!r}")


# raw DeepSpeed keys polynya sets from its own settings (``_deepspeed.ds_config``): an override
# would change the update behind those settings' backs (DeepSpeed scales each loss by
# 1 / gradient_accumulation_steps, clips by its own gradient_clipping, casts by bf16 / fp16, ...)
MANAGED_DEEPSPEED_KEYS = {
    "train_batch_size": "micro-batches are planned by tokens (micro_batch_tokens); a step is one "
                        "step() call",
    "train_micro_batch_size_per_gpu": "micro-batches are planned by tokens (micro_batch_tokens)",
    "gradient_accumulation_steps": "every forward_backward call accumulates until step()",
    "managed_gradient_accumulation": "every forward_backward call accumulates until step()",
    "gradient_clipping": "set OptimConfig.grad_clip",
    "bf16": "set dtype", "fp16": "set dtype", "amp": "set dtype",
    "optimizer": "polynya builds AdamW from OptimConfig", "scheduler": "set OptimConfig.schedule",
    "zero_optimization.stage": "set zero_stage",
}


def check_deepspeed_overrides(value: object, owner: str) -> None:
    """``ValueError`` unless ``value`` is a dict of raw DeepSpeed settings that leaves the keys
    polynya sets itself (``MANAGED_DEEPSPEED_KEYS``) alone."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{owner}.deepspeed must be a dict of raw DeepSpeed settings, got {value!r}")
    zero = value.get("zero_optimization")
    keys = [*value, *(f"zero_optimization.{k}" for k in zero)] if isinstance(zero, dict) else list(value)
    for key in keys:
        if key in MANAGED_DEEPSPEED_KEYS:
            raise ValueError(f"{owner}.deepspeed sets {key!r}, which polynya sets itself: "
                             f"{MANAGED_DEEPSPEED_KEYS[key]} instead")


@dataclass
class OptimConfig:
    """AdamW, LR schedule and gradient clipping.

    Args:
        betas, eps, weight_decay: AdamW (``torch.optim.AdamW``; decoupled weight decay).
        schedule: ``"constant"`` (after ``warmup_steps`` of linear warm-up) or
            ``"warmup_cosine"`` (linear warm-up, then cosine from ``lr`` to ``min_lr_ratio * lr``
            at ``total_steps``).
        warmup_steps: optimizer steps of linear warm-up from 0 (0 = none).
        total_steps: length of the cosine; required for ``"warmup_cosine"``.
        min_lr_ratio: floor of the cosine as a fraction of ``lr``.
        grad_clip: clip the global gradient norm to this value (0 = no clipping).
        fused: run AdamW's update as one kernel per tensor list (``torch.optim.AdamW(fused=True)``:
            each fp32 master weight, gradient and moment read and written once, instead of the
            ~10 passes of the multi-tensor update). ``None`` (default) = on CUDA, off elsewhere;
            the same algorithm, equal up to floating-point rounding.
    """

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    fused: bool | None = None

    def __post_init__(self) -> None:
        if self.fused is not None and not isinstance(self.fused, bool):
            raise ValueError(f"OptimConfig.fused must be True, False or None (= on CUDA), got {self.fused!r}")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"OptimConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        check_positive(self.eps, "OptimConfig.eps")
        check_positive(self.weight_decay, "OptimConfig.weight_decay", allow_zero=True)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        check_positive(self.warmup_steps, "OptimConfig.warmup_steps", allow_zero=True, integer=True)
        if self.total_steps is not None:
            check_positive(self.total_steps, "OptimConfig.total_steps", integer=True)
        if self.schedule == "warmup_cosine":
            if self.total_steps is None:
                raise ValueError("OptimConfig.total_steps is required for schedule='warmup_cosine'")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(f"OptimConfig.total_steps ({self.total_steps}) must exceed "
                                 f"warmup_steps ({self.warmup_steps})")
        if isinstance(self.min_lr_ratio, bool) or not isinstance(self.min_lr_ratio, (int, float)) \
                or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        check_positive(self.grad_clip, "OptimConfig.grad_clip", allow_zero=True)

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class LossConfig:
    """Settings of the policy loss (see ``polynya.losses`` for the formulas).

    Args:
        clip_low, clip_high: ratio clip range ``[1 - clip_low, 1 + clip_high]``; ``None`` takes
            the loss's default (PPO/GRPO/Dr.GRPO 0.2/0.2, DAPO 0.2/0.28, GSPO 3e-4/4e-4).
        norm: override the loss's normalisation (``"token"``, ``"sequence"``, ``"constant"``, or
            ``"sum"``: weight 1 per token, for advantages that already carry the normalisation,
            as SkyRL's trainer pre-scales them); ``None`` keeps the loss's own.
        kl_norm: normalisation of the KL term alone (same choices); ``None`` = ``norm``.
        max_response_len: the constant of Dr.GRPO's ``"constant"`` normalisation; ``None`` uses
            the longest response of the global batch.
        kl_coef: weight of the KL-to-reference penalty (needs ``batch.ref_logprobs``; 0 = off).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (Schulman's estimators).
        entropy_coef: weight of the entropy bonus (0 = off).
        log_ratio_clip: clamp each log importance ratio to ``[-c, c]`` before ``exp`` (its
            gradient is 0 outside), as verl's and SkyRL's PPO losses do with ``c = 20``; ``None``
            = no clamp.
        kl_clip: clamp each token's KL estimate to ``[-c, c]`` (its gradient is 0 outside), as
            SkyRL's and verl's k3 do with ``c = 10``; ``None`` = no clamp.
    """

    clip_low: float | None = None
    clip_high: float | None = None
    norm: str | None = None
    kl_norm: str | None = None
    max_response_len: int | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    log_ratio_clip: float | None = None
    kl_clip: float | None = None

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high", "log_ratio_clip", "kl_clip"):
            v = getattr(self, name)
            if v is not None:
                check_positive(v, f"LossConfig.{name}")
                if name.endswith("_clip") and not math.isfinite(v):
                    raise ValueError(f"LossConfig.{name} must be finite (None = no clamp), got {v!r}")
        if self.clip_low is not None and self.clip_low >= 1.0:
            raise ValueError(f"LossConfig.clip_low must be < 1, got {self.clip_low!r}")
        for name in ("norm", "kl_norm"):
            v = getattr(self, name)
            if v is not None and v not in NORMS:
                raise ValueError(f"LossConfig.{name} must be one of {NORMS} or None, got {v!r}")
        if self.max_response_len is not None:
            check_positive(self.max_response_len, "LossConfig.max_response_len", integer=True)
        check_positive(self.kl_coef, "LossConfig.kl_coef", allow_zero=True)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"LossConfig.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if not isinstance(self.entropy_coef, (int, float)) or not math.isfinite(self.entropy_coef):
            raise ValueError(f"LossConfig.entropy_coef must be a finite number, got {self.entropy_coef!r}")


@dataclass
class TrainConfig:
    """Training-engine settings.

    Args:
        model: HF id, local path, ``tiny:<family>`` or ``random:<shape>`` (``polynya.models``).
        dtype: ``"bfloat16"`` (DeepSpeed bf16: bf16 weights, fp32 master weights and optimizer
            state) or ``"float32"``.
        zero_stage: DeepSpeed ZeRO stage 0-3.
        lr: peak learning rate.
        zorro: compute each shared prompt once (ZoRRo Train); False = every sample on its own.
        zorro_attention: GPU attention of the packed layouts, ``"auto"`` / ``"split"`` /
            ``"flex"`` / ``"varlen"`` (``polynya.compute_logprobs``).
        naive_layout: layout with ``zorro=False``: ``"auto"`` / ``"packed"`` (samples back to
            back without padding) / ``"padded"`` (one row per sample) (``compute_logprobs``).
        loss: ``"ppo"``, ``"grpo"``, ``"dapo"``, ``"dr_grpo"`` or ``"gspo"``.
        seed: model init (random specs) and torch seed.
        optim: AdamW / schedule / clipping (``OptimConfig``).
        loss_config: loss knobs (``LossConfig``).
        micro_batch_tokens: token budget of a micro-batch (deduplicated tokens with ``zorro``);
            whole prompt groups only, a group over budget is a micro-batch of its own.
        max_tokens_per_row: ZoRRo packing budget per row inside a micro-batch (None: one row).
        temperature: sampling temperature of the rollouts (log-probs are taken at it).
        gradient_checkpointing: recompute decoder layers in the backward pass.
        fused_kernels: run the model's RMSNorms and RoPE as fused Triton kernels on CUDA
            (``polynya.fused.fuse_model``: HF's exact math, fewer launches); CPU unchanged.
        compile_layers: run each decoder layer as two ``torch.compile`` regions around its
            attention (``polynya.compiled_layers``; Llama / Qwen2 / Qwen3 / Mistral; not with
            ``fused_kernels`` nor ZeRO-3). Compiles for tens of seconds at the first step.
        log_entropy: compute the entropy metric even when ``entropy_coef == 0``.
        device: ``"cpu"``, ``"cuda"``; ``None`` = CUDA when available (``LOCAL_RANK``'s GPU).
        deepspeed: raw DeepSpeed settings merged over the generated config (nested dicts merge).
        export_hf: ``save(path)`` also writes a Hugging Face export (weights + tokenizer) to
            ``<path>/hf``.
    """

    model: str
    dtype: str = "bfloat16"
    zero_stage: int = 2
    lr: float = 1e-6
    zorro: bool = True
    zorro_attention: str = "auto"
    naive_layout: str = "auto"
    loss: str = "grpo"
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss_config: LossConfig = field(default_factory=LossConfig)
    micro_batch_tokens: int = 16384
    max_tokens_per_row: int | None = None
    temperature: float = 1.0
    gradient_checkpointing: bool = False
    fused_kernels: bool = False
    compile_layers: bool = False
    log_entropy: bool = True
    device: str | None = None
    deepspeed: dict[str, Any] = field(default_factory=dict)
    export_hf: bool = True

    def __post_init__(self) -> None:
        check_model_spec(self.model, "TrainConfig")
        resolve_dtype(self.dtype, ENGINE_DTYPES)
        check_zero_stage(self.zero_stage, "TrainConfig")
        check_positive(self.lr, "TrainConfig.lr", allow_zero=True)
        _check_bool(self.zorro, "TrainConfig.zorro")
        check_zorro_attention(self.zorro_attention, "TrainConfig")
        check_naive_layout(self.naive_layout, "TrainConfig")
        if self.loss not in LOSSES:
            raise ValueError(f"TrainConfig.loss must be one of {LOSSES}, got {self.loss!r}")
        _check_seed(self.seed, "TrainConfig.seed")
        if isinstance(self.optim, dict):
            self.optim = OptimConfig(**self.optim)
        if isinstance(self.loss_config, dict):
            self.loss_config = LossConfig(**self.loss_config)
        if not isinstance(self.optim, OptimConfig):
            raise ValueError(f"TrainConfig.optim must be an OptimConfig, got {type(self.optim).__name__}")
        if not isinstance(self.loss_config, LossConfig):
            raise ValueError(f"TrainConfig.loss_config must be a LossConfig, got {type(self.loss_config).__name__}")
        check_positive(self.micro_batch_tokens, "TrainConfig.micro_batch_tokens", integer=True)
        if self.max_tokens_per_row is not None:
            check_positive(self.max_tokens_per_row, "TrainConfig.max_tokens_per_row", integer=True)
        check_temperature(self.temperature, "TrainConfig.temperature")
        _check_bool(self.gradient_checkpointing, "TrainConfig.gradient_checkpointing")
        _check_bool(self.fused_kernels, "TrainConfig.fused_kernels")
        check_compile_layers(self.compile_layers, self.fused_kernels, self.zero_stage, "TrainConfig")
        _check_bool(self.log_entropy, "TrainConfig.log_entropy")
        check_device(self.device, "TrainConfig")
        check_deepspeed_overrides(self.deepspeed, "TrainConfig")
        _check_bool(self.export_hf, "TrainConfig.export_hf")


def check_compile_layers(compile_layers: object, fused_kernels: bool, zero_stage: int,
                         owner: str) -> None:
    _check_bool(compile_layers, f"{owner}.compile_layers")
    if compile_layers and fused_kernels:
        raise ValueError(f"{owner}: compile_layers and fused_kernels both replace the layers' "
                         "forwards; pick one (compile_layers fuses the same ops)")
    if compile_layers and zero_stage == 3:
        raise ValueError(f"{owner}: compile_layers does not run under ZeRO-3 (its parameter "
                         "gathering hooks would be traced); use zero_stage 0-2 or compile_layers=False")


def check_device(device: object, owner: str) -> None:
    if device is not None and (not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda")):
        raise ValueError(f"{owner}.device must be 'cpu', 'cuda' or None, got {device!r}")

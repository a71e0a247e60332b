"""``LogProbConfig``: how to build a log-prob engine (``polynya.engines.LogProbEngine``).

The log-prob engine is forward-only: reference log-probs (a frozen copy) and old-policy
log-probs (refreshed with ``load_weights``). ZeRO-3 shards its weights over the data-parallel
ranks; stage 0 keeps a full copy per rank::

    cfg = LogProbConfig("tiny:qwen3", dtype="float32", zero_stage=3)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .common import (check_model_spec, check_naive_layout, check_positive, check_temperature,
                     check_zorro_attention, resolve_dtype)
from .train import (
    ENGINE_DTYPES,
    _check_bool,
    _check_seed,
    check_compile_layers,
    check_deepspeed_overrides,
    check_device,
    check_zero_stage,
)


@dataclass
class LogProbConfig:
    """Log-prob-engine settings.

    Args:
        model: HF id, local path, ``tiny:<family>`` or ``random:<shape>`` (``polynya.models``).
        dtype: ``"bfloat16"`` or ``"float32"``.
        zero_stage: 0 (full copy on each rank) or 3 (weights sharded, gathered layer by layer).
        zorro: compute each shared prompt once; False = every sample on its own.
        zorro_attention: GPU attention of the packed layouts, ``"auto"`` / ``"split"`` /
            ``"flex"`` / ``"varlen"`` (``polynya.compute_logprobs``).
        naive_layout: layout with ``zorro=False``: ``"auto"`` / ``"packed"`` (samples back to
            back without padding) / ``"padded"`` (one row per sample) (``compute_logprobs``).
        temperature: default temperature of ``compute_logprobs``.
        micro_batch_tokens: token budget of a forward micro-batch (whole prompt groups).
        max_tokens_per_row: ZoRRo packing budget per row (None: one row per micro-batch).
        seed: model init for random specs (same seed as the trainer = same weights).
        fused_kernels: run the model's RMSNorms and RoPE as fused Triton kernels on CUDA
            (``polynya.fused.fuse_model``); CPU unchanged.
        compile_layers: run each decoder layer as two ``torch.compile`` regions around its
            attention (``polynya.compiled_layers``; not with ``fused_kernels`` nor ZeRO-3).
        device: ``"cpu"``, ``"cuda"``; ``None`` = CUDA when available.
        deepspeed: raw DeepSpeed settings merged over the generated config.
    """

    model: str
    dtype: str = "bfloat16"
    zero_stage: int = 0
    zorro: bool = True
    zorro_attention: str = "auto"
    naive_layout: str = "auto"
    temperature: float = 1.0
    micro_batch_tokens: int = 32768
    max_tokens_per_row: int | None = None
    seed: int = 0
    fused_kernels: bool = False
    compile_layers: bool = False
    device: str | None = None
    deepspeed: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_model_spec(self.model, "LogProbConfig")
        resolve_dtype(self.dtype, ENGINE_DTYPES)
        check_zero_stage(self.zero_stage, "LogProbConfig", allowed=(0, 3))
        _check_bool(self.zorro, "LogProbConfig.zorro")
        check_zorro_attention(self.zorro_attention, "LogProbConfig")
        check_naive_layout(self.naive_layout, "LogProbConfig")
        check_temperature(self.temperature, "LogProbConfig.temperature")
        check_positive(self.micro_batch_tokens, "LogProbConfig.micro_batch_tokens", integer=True)
        if self.max_tokens_per_row is not None:
            check_positive(self.max_tokens_per_row, "LogProbConfig.max_tokens_per_row", integer=True)
        _check_seed(self.seed, "LogProbConfig.seed")
        _check_bool(self.fused_kernels, "LogProbConfig.fused_kernels")
        check_compile_layers(self.compile_layers, self.fused_kernels, self.zero_stage, "LogProbConfig")
        check_device(self.device, "LogProbConfig")
        check_deepspeed_overrides(self.deepspeed, "LogProbConfig")

"""Validation helpers shared by the engine configs."""
from __future__ import annotations

import math

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def resolve_dtype(name: str | torch.dtype, allowed: tuple[str, ...] = tuple(DTYPES)) -> torch.dtype:
    """Map a dtype name (``"bfloat16"``, ``"bf16"``, ``torch.float32`` ...) to a torch dtype."""
    if isinstance(name, torch.dtype):
        name = {v: k for k, v in DTYPES.items()}.get(name, str(name))
    key = _ALIASES.get(str(name), str(name))
    if key not in DTYPES or key not in allowed:
        raise ValueError(f"dtype {name!r} is not supported here; choose one of {list(allowed)}")
    return DTYPES[key]


def check_model_spec(model: object, owner: str) -> None:
    """A model is an HF id, a local path, or a ``tiny:``/``random:`` spec of polynya.models."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"{owner}.model must be a non-empty string (HF id, local path, or 'tiny:qwen3'), got {model!r}")


ZORRO_ATTENTION = ("auto", "split", "flex", "varlen")  # GPU attention paths of polynya.zorro.attention
NAIVE_LAYOUT = ("auto", "packed", "padded")  # zorro=False layouts of polynya.compute_logprobs


def check_zorro_attention(value: object, owner: str) -> None:
    if value not in ZORRO_ATTENTION:
        raise ValueError(f"{owner}.zorro_attention must be one of {ZORRO_ATTENTION}, got {value!r}")


def check_naive_layout(value: object, owner: str) -> None:
    if value not in NAIVE_LAYOUT:
        raise ValueError(f"{owner}.naive_layout must be one of {NAIVE_LAYOUT}, got {value!r}")


def check_temperature(value: object, name: str) -> None:
    """A log-prob temperature: a finite number >= ``MIN_TEMPERATURE`` (the sampler's floor; below
    it ``logits / temperature`` overflows float32)."""
    from ..types import MIN_TEMPERATURE

    check_positive(value, name)
    if not math.isfinite(value) or value < MIN_TEMPERATURE:
        raise ValueError(f"{name} must be finite and >= {MIN_TEMPERATURE}, got {value!r} (log-probs at "
                         "temperature 0 are undefined; 1.0 gives the policy's own)")


def check_positive(value: object, name: str, *, allow_zero: bool = False, integer: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or value < 0 or (value == 0 and not allow_zero):
        kind = "an integer" if integer else "a number"
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {kind} {bound}, got {value!r}")

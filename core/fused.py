"""Fused training kernels for Hugging Face models: ``fuse_model`` / ``unfuse_model``.

At the micro-batches RL trains on (a few thousand tokens), a forward + backward of a 0.6B model
is bound by the host launching ~10k small kernels, and HF's RMSNorm is a large share of them
(~8 ops forward, ~12 backward, four norms per Qwen3 layer). ``fuse_model(model)`` makes every
RMSNorm whose class is on ``RMS_NORM_CLASSES`` run ``polynya.kernels.norm.rms_norm`` (one launch
forward, two backward) on CUDA tensors::

    from polynya.fused import fuse_model, unfuse_model
    names = fuse_model(model)     # ["model.layers.0.input_layernorm", ...]
    unfuse_model(model)           # back to HF's forward

What it does and guarantees:

- It sets an instance-level ``forward`` on each matching module and changes nothing else (no
  weight, buffer, hook or class is touched). The fused forward reads ``self.weight`` and
  ``self.variance_epsilon`` at call time, so it follows ``model.to(...)``, DeepSpeed ZeRO-3
  (parameters gathered by the module's own pre-forward hook) and HF's non-reentrant gradient
  checkpointing (which re-runs the forward in the backward).
- Only the exact math of HF's Llama-style RMSNorm is fused: ``weight * (x.float() *
  rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``. A class is fused only if it is on the allow-list
  *and* its ``forward`` equals ``rms_norm_reference`` bit for bit on a random probe (fp32 and
  bf16, checked once per class per process), so a transformers release that changes the math
  is refused (left on HF's forward, with a warning). Gemma's norms (``1 + weight``, another cast
  order) are not on the list.
- Tensors on the CPU (and dtypes or widths the kernels do not take) run HF's own forward, so
  CPU numbers do not move.
- Idempotent (a fused module is left as it is) and reversible (``unfuse_model``). A module that
  already has an instance-level ``forward`` from someone else (accelerate's hooks) is skipped.
"""
from __future__ import annotations

import functools
import types
import warnings

import torch

RMS_NORM_CLASSES = (  # each checked in transformers 5.17: the same five-line forward
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward ``fuse_model`` installs: the Triton kernels where they apply, else HF's."""
    from .kernels.norm import kernel_applies, rms_norm

    weight = self.weight
    if kernel_applies(hidden_states, weight):
        return rms_norm(hidden_states, weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


@functools.cache
def _math_matches(cls: type) -> bool:
    """``cls.forward`` equals ``rms_norm_reference`` bit for bit on random fp32 and bf16 probes
    (a weight far from 1, so ``1 + weight`` or a different cast order shows)."""
    from .kernels.norm import rms_norm_reference

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 5, 48, generator=g) * 4).to(dtype)
        probe = types.SimpleNamespace(weight=(torch.randn(48, generator=g) * 2).to(dtype),
                                      variance_epsilon=1e-5)
        try:
            with torch.no_grad():
                got = cls.forward(probe, x)
        except Exception:  # noqa: BLE001 - any other forward (other attributes) is not ours
            return False
        want = rms_norm_reference(x, probe.weight, 1e-5)
        same = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        if not same:
            return False
    return True


def _is_fused(module: torch.nn.Module) -> bool:
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, functools.partial) and fwd.func is _fused_rms_norm_forward


def _fusable(module: torch.nn.Module) -> bool:
    cls = type(module)
    if _class_name(cls) not in RMS_NORM_CLASSES:
        return False
    if not _math_matches(cls):
        warnings.warn(f"polynya.fused: {_class_name(cls)}.forward no longer computes HF's "
                      "Llama RMSNorm math; it keeps its own forward (not fused)", stacklevel=3)
        return False
    return True


def fuse_model(model: torch.nn.Module) -> list[str]:
    """Make ``model``'s allow-listed RMSNorms run the fused kernels on CUDA (module docstring).

    Args:
        model: any ``torch.nn.Module`` (an HF model, a DeepSpeed engine wrapping one, ...).
    Returns:
        The qualified names of the modules running the fused forward after the call (fused now
        or by an earlier call), in ``named_modules`` order; ``[]`` when the model has none.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"fuse_model needs a torch.nn.Module, got {type(model).__name__}")
    fused = []
    for name, module in model.named_modules():
        if _is_fused(module):
            fused.append(name)
        elif "forward" not in module.__dict__ and _fusable(module):
            # a partial of a module-level function (not a bound method): deepcopy and pickle
            # of the model keep working and carry the fusion along
            module.forward = functools.partial(_fused_rms_norm_forward, module)
            fused.append(name)
    return fused


def unfuse_model(model: torch.nn.Module) -> list[str]:
    """Undo ``fuse_model``: -> the names of the modules given back their class's forward."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"unfuse_model needs a torch.nn.Module, got {type(model).__name__}")
    restored = []
    for name, module in model.named_modules():
        if _is_fused(module):
            del module.forward
            restored.append(name)
    return restored


def fused_modules(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s modules running a fused forward now."""
    return [name for name, module in model.named_modules() if _is_fused(module)]

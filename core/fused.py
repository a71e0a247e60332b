"""Fused training kernels for Hugging Face models: ``fuse_model`` / ``unfuse_model``.

At the micro-batches RL trains on (a few thousand tokens), a forward + backward of a 0.6B model
is bound by the host launching ~10k small kernels. HF's RMSNorm (~8 ops forward, ~12 backward,
four per Qwen3 layer) and rotary embedding (~16 ops forward per layer) are a large share of
them. ``fuse_model(model)`` makes them run polynya's Triton kernels on CUDA tensors::

    from polynya.fused import fuse_model, unfuse_model
    names = fuse_model(model)     # ["model.layers.0.self_attn", "...self_attn.q_norm", ...]
    unfuse_model(model)           # back to HF's forwards

- RMSNorm: modules whose class is on ``RMS_NORM_CLASSES`` run ``polynya.kernels.norm.rms_norm``
  (one launch forward, two backward).
- RoPE: attention modules whose class is on ``ATTENTION_CLASSES`` call their modeling file's
  ``apply_rotary_pos_emb``; while a fused one runs (its instance-level forward marks the
  thread), that function runs ``polynya.kernels.rope.rope`` (one launch forward, one backward,
  for ``q`` and ``k`` together). The function is replaced once per modeling file by a wrapper
  that calls the original whenever no fused attention is running on the thread, so models that
  are not fused (and every model after ``unfuse_model``) run HF's code.

What it guarantees:

- Only instance-level ``forward`` attributes are set (and the one wrapper per modeling file):
  no weight, buffer, hook or class is touched. The fused forwards read ``self.weight`` /
  ``self.variance_epsilon`` at call time, so they follow ``model.to(...)``, DeepSpeed ZeRO-3
  (parameters gathered by each module's own pre-forward hook) and HF's non-reentrant gradient
  checkpointing (which re-runs the forwards in the backward).
- Only HF's exact math is fused. A class is fused only if it is on the allow-list *and* its
  math equals the torch reference bit for bit on random fp32 and bf16 probes (norm: its
  ``forward``; RoPE: its file's ``apply_rotary_pos_emb``, which its ``forward`` must call),
  checked once per class per process; a transformers release that changes the math is refused
  (left on HF's code, with a warning). Gemma's norms (``1 + weight``, another cast order) are
  not on the list.
- CPU tensors (and dtypes or shapes the kernels do not take) run HF's own code, so CPU numbers
  do not move.
- Idempotent, and reversible with ``unfuse_model``. A module that already has an instance-level
  ``forward`` from someone else (accelerate's hooks) is skipped.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
import warnings

import torch

from .kernels.norm import kernel_applies as _norm_applies
from .kernels.norm import rms_norm, rms_norm_reference
from .kernels.rope import kernel_applies as _rope_applies
from .kernels.rope import rope, rope_reference

_T = "transformers.models."
RMS_NORM_CLASSES = (  # each checked in transformers 5.17: the same five-line forward
    _T + "llama.modeling_llama.LlamaRMSNorm",
    _T + "qwen2.modeling_qwen2.Qwen2RMSNorm",
    _T + "qwen3.modeling_qwen3.Qwen3RMSNorm",
    _T + "qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
    _T + "mistral.modeling_mistral.MistralRMSNorm",
)
ATTENTION_CLASSES = (  # each calls its file's rotate_half apply_rotary_pos_emb (5.17)
    _T + "llama.modeling_llama.LlamaAttention",
    _T + "qwen2.modeling_qwen2.Qwen2Attention",
    _T + "qwen3.modeling_qwen3.Qwen3Attention",
    _T + "qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention",
    _T + "mistral.modeling_mistral.MistralAttention",
)
_ROPE_FN = "apply_rotary_pos_emb"
_in_fused_attention = threading.local()  # .depth > 0 while a fused attention forward runs


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ------------------------------------------------------------------ the installed forwards
def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The norm forward ``fuse_model`` installs: the Triton kernels where they apply, else HF's."""
    weight = self.weight
    if _norm_applies(hidden_states, weight):
        return rms_norm(hidden_states, weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def _fused_attention_forward(self, *args, **kwargs):
    """The attention forward ``fuse_model`` installs: HF's, with RoPE fused on this thread."""
    state = _in_fused_attention
    state.depth = getattr(state, "depth", 0) + 1
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        state.depth -= 1


def _rope_dispatcher(original):
    """``apply_rotary_pos_emb`` of a modeling file: the fused kernel inside a fused attention's
    forward (when it applies), ``original`` everywhere else."""
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (getattr(_in_fused_attention, "depth", 0) > 0 and args in ((), (1,))
                and kwargs in ({}, {"unsqueeze_dim": 1})  # HF's default [B, H, T, D] layout
                and _rope_applies(q, k, cos, sin)):
            return rope(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.polynya_original = original
    return apply_rotary_pos_emb


# ------------------------------------------------------------------ math probes (once per class)
def _probe_equal(fn, reference, make_args) -> bool:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        args = make_args(g, dtype)
        try:
            with torch.no_grad():
                got, want = fn(*args), reference(*args)
        except Exception:  # noqa: BLE001 - a function of another shape is not the one we fuse
            return False
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        if not (isinstance(got, tuple) and len(got) == len(want) and all(
                isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
                for a, b in zip(got, want))):
            return False
    return True


@functools.cache
def _norm_math_matches(cls: type) -> bool:
    """``cls.forward`` equals ``rms_norm_reference`` (a weight far from 1, so ``1 + weight`` or
    another cast order shows)."""
    def args(g, dtype):
        probe = types.SimpleNamespace(weight=(torch.randn(48, generator=g) * 2).to(dtype),
                                      variance_epsilon=1e-5)
        return probe, (torch.randn(3, 5, 48, generator=g) * 4).to(dtype)

    return _probe_equal(lambda m, x: cls.forward(m, x),
                        lambda m, x: rms_norm_reference(x, m.weight, m.variance_epsilon), args)


@functools.cache
def _rope_math_matches(cls: type) -> bool:
    """``cls.forward`` calls its file's ``apply_rotary_pos_emb`` and that equals
    ``rope_reference`` (cos/sin halves that differ, so a non-rotate_half pairing shows)."""
    if _ROPE_FN not in inspect.unwrap(cls.forward).__code__.co_names:
        return False
    fn = getattr(sys.modules[cls.__module__], _ROPE_FN, None)
    fn = getattr(fn, "polynya_original", fn)

    def args(g, dtype):
        q, k = (torch.randn(2, h, 5, 16, generator=g).to(dtype) for h in (4, 2))
        return q, k, torch.randn(2, 5, 16, generator=g).to(dtype), torch.randn(
            2, 5, 16, generator=g).to(dtype)

    return callable(fn) and _probe_equal(fn, rope_reference, args)


# ------------------------------------------------------------------ patching
def _is_fused(module: torch.nn.Module) -> bool:
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, functools.partial) and fwd.func in (_fused_rms_norm_forward,
                                                               _fused_attention_forward)


def _fused_forward_for(module: torch.nn.Module):
    """The fused forward for ``module``'s class, or None (not listed, or its math changed)."""
    cls = type(module)
    kinds = ((RMS_NORM_CLASSES, _norm_math_matches, _fused_rms_norm_forward),
             (ATTENTION_CLASSES, _rope_math_matches, _fused_attention_forward))
    for classes, matches, forward in kinds:
        if _class_name(cls) in classes:
            if matches(cls):
                return forward
            warnings.warn(f"polynya.fused: {_class_name(cls)} no longer computes HF's math "
                          "that polynya fuses; it keeps its own forward (not fused)", stacklevel=4)
    return None


def _install_rope_dispatcher(cls: type) -> None:
    mod = sys.modules[cls.__module__]
    fn = getattr(mod, _ROPE_FN)
    if not hasattr(fn, "polynya_original"):
        setattr(mod, _ROPE_FN, _rope_dispatcher(fn))


def fuse_model(model: torch.nn.Module) -> list[str]:
    """Make ``model``'s allow-listed RMSNorms and attention RoPE run the fused kernels on CUDA
    (module docstring).

    Args:
        model: any ``torch.nn.Module`` (an HF model, a DeepSpeed engine wrapping one, ...).
    Returns:
        The qualified names of the modules running a fused forward after the call (fused now or
        by an earlier call), in ``named_modules`` order; ``[]`` when the model has none.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"fuse_model needs a torch.nn.Module, got {type(model).__name__}")
    fused = []
    for name, module in model.named_modules():
        if _is_fused(module):
            fused.append(name)
            continue
        if "forward" in module.__dict__:
            continue
        forward = _fused_forward_for(module)
        if forward is None:
            continue
        if forward is _fused_attention_forward:
            _install_rope_dispatcher(type(module))
        # a partial of a module-level function (not a bound method): deepcopy and pickle of the
        # model keep working and carry the fusion along
        module.forward = functools.partial(forward, module)
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

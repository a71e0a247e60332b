"""Training forwards with the decoder layers compiled in two regions each: ``compile_layers``.

At the micro-batches RL trains on (one prompt group, a few thousand tokens) a forward +
backward of a 0.6B model is paced by the host dispatching ~100 small aten ops per layer
(RMSNorms, RoPE, SiLU * mul, casts, views), not by the GPU. ``compile_layers(model)`` runs every
decoder layer as two ``torch.compile`` (Inductor) regions around its attention call, which fuse
those element-wise ops around the GEMMs in forward and backward::

    from polynya.compiled_layers import compile_layers, uncompile_layers
    names = compile_layers(model)     # ["model.layers.0", "model.layers.1", ...]
    uncompile_layers(model)           # back to the eager forwards

What it does and guarantees:

- Each decoder layer gets an instance-level ``forward`` that computes what its class's forward
  computes, in three parts: *before* (input RMSNorm, q/k/v projections, Qwen3's q/k norms,
  RoPE: one compiled region), the attention function the model is configured with (called
  eagerly, exactly as the class calls it: same arguments, sliding window included), and
  *after* (output projection, residual, post-attention RMSNorm, MLP, residual: one compiled
  region). One compiled function per part and class serves every layer (parameters are graph
  inputs). Two regions per layer and pass, where compiling the sub-modules one by one cost
  ~14 (every graph break splits each enclosing frame), is what takes the host's share down.
- The attention function itself (polynya's ZoRRo / packed-varlen attention, or any other) is
  never traced, so ZoRRo's plans and every attention path of ``compute_logprobs`` stay
  unchanged.
- HF's gradient checkpointing wraps the new forward whichever way a transformers release wires
  it (in ``__call__``, 5.17; in the class ``forward``, 5.24: the new forward then checkpoints
  itself under the same conditions), so the recompute in the backward pass runs the compiled
  regions again.
- Any call the two regions do not cover runs the class's own forward, eagerly: a KV cache
  (generation), extra positional arguments, no ``position_embeddings``, or forward / backward
  hooks on the attention module (HF's output recorders, accelerate). No weight, buffer or class
  is changed.
- Shapes are dynamic (``dynamic=True``): a new number of tokens does not recompile. Compiling
  costs tens of seconds once per process (Inductor's on-disk cache makes a later process
  cheaper); a recompile beyond ``torch._dynamo.config`` 's limit falls back to eager (torch's
  behaviour), never to other numbers.
- Only the decoder-layer classes in ``LAYER_CLASSES`` (dense Llama, Qwen2, Qwen3, Mistral,
  whose forwards the regions mirror; Mistral's sliding window is applied by the attention) under
  the transformers releases ``VERIFIED_TRANSFORMERS`` covers (compiled equal to eager in
  ``tests/core/test_compiled_layers.py`` under 5.24 and, in the verl environment, 5.10) are
  compiled; any other model or release is refused with a ``ValueError`` rather than guessed at
  (mixture-of-experts routing, Gemma's soft-caps and norms are not verified).
- Idempotent; reversible with ``uncompile_layers``. A layer or sub-module that already has an
  instance-level ``forward`` from someone else (``polynya.fused``, accelerate's hooks) is refused.
"""
from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .dynamo import fresh_function
from .model_features import decoder_layers

_T = "transformers.models."
# decoder layer -> (its attention has q/k RMSNorms, where its attention reads sliding_window:
# "module" = attn.sliding_window, "config" = attn.config.sliding_window, None = not passed)
_FAMILIES: dict[str, tuple[bool, str | None]] = {
    _T + "llama.modeling_llama.LlamaDecoderLayer": (False, None),
    _T + "qwen2.modeling_qwen2.Qwen2DecoderLayer": (False, "module"),
    _T + "qwen3.modeling_qwen3.Qwen3DecoderLayer": (True, "module"),
    _T + "mistral.modeling_mistral.MistralDecoderLayer": (False, "config"),
}
LAYER_CLASSES = tuple(_FAMILIES)
# the transformers releases whose layer forwards the regions are checked against (pyproject's range)
VERIFIED_TRANSFORMERS = ("5.10", "5.25")
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")  # names of the KV cache, by release


@dataclass(frozen=True)
class _Regions:
    """A layer class's compiled parts and what its attention call needs."""
    before: Callable
    after: Callable
    rope: Callable          # the family's apply_rotary_pos_emb
    eager_attention: Callable  # the family's eager_attention_forward (HF's fallback interface)
    interfaces: Any         # transformers' ALL_ATTENTION_FUNCTIONS (looked up per call, as HF does)
    qk_norm: bool
    window: str | None


_COMPILED: dict[tuple[type, str, bool], _Regions] = {}
_LOCK = threading.Lock()


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _before_attention(layer, hidden_states, cos, sin, rope, qk_norm: bool):
    """Input RMSNorm, q/k/v projections (+ q/k norms), RoPE: ``[b, L, h]`` -> q, k, v
    ``[b, H, L, D]``, as the families' attention forwards compute them."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden_states)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, attn.v_proj(x).view(shape).transpose(1, 2)


def _after_attention(layer, residual, attn_output):
    """Output projection, residual, post-attention RMSNorm, MLP, residual -> ``[b, L, h]``."""
    out = layer.self_attn.o_proj(attn_output.reshape(*residual.shape[:-1], -1).contiguous())
    hidden = residual + out
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def family_reason(cls: type) -> str | None:
    """Why decoder layers of class ``cls`` cannot run as compiled regions, or None."""
    import transformers
    from packaging.version import Version

    low, high = VERIFIED_TRANSFORMERS
    if not Version(low) <= Version(transformers.__version__) < Version(high):
        return (f"compiled regions mirror the decoder layers of transformers >= {low}, < {high}; "
                f"transformers {transformers.__version__} is not verified")
    name = _class_name(cls)
    if name not in _FAMILIES:
        return (f"compiled regions support the decoder layers "
                f"{', '.join(c.rsplit('.', 1)[1] for c in LAYER_CLASSES)}; {name} is not verified")
    return None


def layer_regions(cls: type, backend: str | Callable = "inductor", dynamic: bool = True, *,
                  shared: bool = True) -> _Regions:
    """The compiled regions of decoder-layer class ``cls`` (one of ``LAYER_CLASSES``).

    ``shared=True``: the process's one set per (class, backend, dynamic), what
    ``compile_layers`` installs. ``shared=False``: a set of the caller's own (fresh code
    objects: its graphs and Dynamo's recompile budget are its alone; the native sampler's
    prefill keeps its inference-mode graphs apart from a colocated trainer's)."""
    if why := family_reason(cls):
        raise ValueError(why)
    key = (cls, backend, dynamic)
    with _LOCK:
        regions = _COMPILED.get(key) if shared else None
        if regions is None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            qk_norm, window = _FAMILIES[_class_name(cls)]
            family = sys.modules[cls.__module__]
            compiled = (torch.compile(fresh_function(f), backend=backend, dynamic=dynamic)
                        for f in (_before_attention, _after_attention))
            regions = _Regions(*compiled, family.apply_rotary_pos_emb,
                               family.eager_attention_forward, ALL_ATTENTION_FUNCTIONS, qk_norm,
                               window)
            if shared:
                _COMPILED[key] = regions
    return regions


def _hooked(module: torch.nn.Module) -> bool:
    from torch.nn.modules import module as nn_module

    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or nn_module._global_forward_hooks
                or nn_module._global_forward_pre_hooks or nn_module._global_backward_hooks
                or nn_module._global_backward_pre_hooks)


def _checkpoints_in_forward(layer: torch.nn.Module) -> bool:
    """transformers 5.2x checkpoints in the class's ``forward`` (its ``forward_with_checkpointing``
    wrapper); earlier 5.x releases in ``GradientCheckpointingLayer.__call__``, around us."""
    code = getattr(type(layer).forward, "__code__", None)
    return code is not None and code.co_name == "forward_with_checkpointing"


def run_regions(regions: _Regions, layer: torch.nn.Module, hidden_states: torch.Tensor,
                attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
    """The layer's forward as before-region, attention (eager), after-region: what the class's
    forward computes, for a call ``covered_kwargs`` accepted (with the kwargs it returned)."""
    attn = layer.self_attn
    q, k, v = regions.before(layer, hidden_states, *position_embeddings, regions.rope, regions.qk_norm)
    attention = regions.interfaces.get_interface(attn.config._attn_implementation,
                                                 regions.eager_attention)
    if regions.window == "module":
        kwargs["sliding_window"] = attn.sliding_window
    elif regions.window == "config":
        kwargs["sliding_window"] = getattr(attn.config, "sliding_window", None)
    out, _ = attention(attn, q, k, v, attention_mask,
                       dropout=0.0 if not attn.training else attn.attention_dropout,
                       scaling=attn.scaling, position_ids=position_ids, **kwargs)
    return regions.after(layer, hidden_states, out)


def covered_kwargs(layer: torch.nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """The keyword arguments ``run_regions`` takes for this layer call (its KV-cache arguments,
    all None, left out), or None when the regions do not cover it: a KV cache, extra
    positional arguments, no rotary embeddings, or hooks on the attention module."""
    if (len(args) != 1 or kwargs.get("position_embeddings") is None or _hooked(layer.self_attn)
            or any(kwargs.get(name) is not None for name in _CACHE_KWARGS)):
        return None
    return {key: value for key, value in kwargs.items() if key not in _CACHE_KWARGS}


def _layer_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward ``compile_layers`` installs (module docstring): two compiled regions for a
    training call, the class's own forward for anything else."""
    covered = covered_kwargs(self, args, kwargs)
    if covered is None:
        return type(self).forward(self, *args, **kwargs)
    regions = self.__dict__["_polynya_compiled"]
    if (_checkpoints_in_forward(self) and self.gradient_checkpointing and self.training
            and torch.is_grad_enabled()):
        return self._gradient_checkpointing_func(
            functools.partial(run_regions, regions, self, **covered), *args)
    return run_regions(regions, self, *args, **covered)


def _is_compiled(module: torch.nn.Module) -> bool:
    return "_polynya_compiled" in module.__dict__


def compile_reason(model: torch.nn.Module) -> str | None:
    """Why ``compile_layers`` refuses ``model``, or None when it takes it."""
    if not isinstance(model, torch.nn.Module):
        return f"compile_layers needs a torch.nn.Module, got {type(model).__name__}"
    if getattr(model, "config", None) is None:
        return (f"compile_layers needs a Hugging Face model (with a .config); got a "
                f"{type(model).__name__} (under DeepSpeed pass engine.module)")
    layers, why = decoder_layers(model)
    if layers is None:
        return why
    if why := family_reason(type(layers[0])):
        return f"{why} (run without compiled layers)"
    for layer in layers:
        if "forward" in layer.__dict__ and not _is_compiled(layer):
            return (f"{type(layer).__name__} already has an instance-level forward "
                    "(accelerate hooks, ...): compiled layers cannot wrap it")
        for child_name, child in layer.named_modules():
            if child_name and "forward" in child.__dict__:
                return (f"{type(child).__name__} {child_name!r} already has an instance-level forward "
                        "(polynya.fused, accelerate hooks, ...): compiled layers cannot wrap it")
    return None


def compile_layers(model: torch.nn.Module, *, backend: str = "inductor",
                   dynamic: bool = True) -> list[str]:
    """Run every decoder layer as two compiled regions around its attention (module docstring).

    Args:
        model: an HF causal LM (or a module holding one: a DeepSpeed engine's ``module``).
        backend: ``torch.compile`` backend; ``"inductor"`` fuses kernels (the point), others
            (``"aot_eager"``) only check the plumbing.
        dynamic: compile with dynamic shapes (no recompile per new token count).
    Returns:
        The qualified names of the compiled decoder layers, in ``named_modules`` order.
    Raises:
        ValueError: the model is not one of ``LAYER_CLASSES``' families, or a layer or one of its
            sub-modules already carries an instance-level forward; nothing is changed then.
    """
    if why := compile_reason(model):
        raise ValueError(why)
    if not isinstance(backend, str) or not isinstance(dynamic, bool):
        raise ValueError(f"backend must be a str and dynamic a bool, got {backend!r}, {dynamic!r}")
    layers, _ = decoder_layers(model)
    targets = {id(layer) for layer in layers}
    names = []
    for name, module in model.named_modules():
        if id(module) not in targets:
            continue
        if not _is_compiled(module):
            module._polynya_compiled = layer_regions(type(module), backend, dynamic)
            module.forward = functools.partial(_layer_forward, module)
        names.append(name)
    return names


def uncompile_layers(model: torch.nn.Module) -> list[str]:
    """Undo ``compile_layers``; returns the names of the layers restored (``[]`` if none)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"uncompile_layers needs a torch.nn.Module, got {type(model).__name__}")
    names = []
    for name, module in model.named_modules():
        if _is_compiled(module):
            del module.__dict__["_polynya_compiled"]
            del module.__dict__["forward"]
            names.append(name)
    return names


def compiled_modules(model: torch.nn.Module) -> list[str]:
    """The decoder layers of ``model`` that run compiled now."""
    return [name for name, module in model.named_modules() if _is_compiled(module)]

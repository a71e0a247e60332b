"""Training forwards with the decoder layers' sub-modules compiled: ``compile_layers``.

At the micro-batches RL trains on (one prompt group, a few thousand tokens) a forward +
backward of a 0.6B model is paced by the host dispatching ~100 small aten ops per layer
(RMSNorms, RoPE, SiLU * mul, casts, views), not by the GPU. ``compile_layers(model)`` routes the
sub-modules of every decoder layer (attention, MLP, norms) through ``torch.compile`` (Inductor),
which fuses those element-wise ops around the GEMMs in forward and backward::

    from polynya.compiled_layers import compile_layers, uncompile_layers
    names = compile_layers(model)     # ["model.layers.0.self_attn", "model.layers.0.mlp", ...]
    uncompile_layers(model)           # back to the eager forwards

What it does and guarantees:

- Each direct child of a decoder layer (``self_attn``, ``mlp``, the norms) gets an
  instance-level ``forward`` that calls its class's own ``forward`` through one compiled
  function per class (parameters are graph inputs, so one graph serves every layer). The
  decoder layer itself, its residual adds and HF's gradient checkpointing around it are
  untouched, whichever way a transformers release wires checkpointing (``__call__`` or the
  class ``forward``): the compiled sub-modules run inside it, and the recompute in the backward
  pass runs them again. No weight, buffer, hook or class is changed.
- The attention function itself (polynya's ZoRRo / packed-varlen attention, or any other) runs
  outside the graph: the ``"polynya"`` attention leaves the graph on its own (a graph break,
  ``polynya.zorro.attention``) and its plans are built eagerly as before, so every layout and
  attention path of ``compute_logprobs`` is unchanged. Inductor compiles the attention
  module's projections, q/k norms and RoPE before the call and the output projection after.
- Shapes are dynamic (``dynamic=True``): a new number of tokens does not recompile. Compiling
  costs tens of seconds once per process (Inductor's on-disk cache makes a later process
  cheaper); a recompile beyond ``torch._dynamo.config`` 's limit falls back to eager (torch's
  behaviour), never to other numbers.
- Only the decoder-layer classes in ``LAYER_CLASSES`` (dense Llama, Qwen2, Qwen3, Mistral in
  transformers 5.x; Mistral's sliding window is applied by the attention, outside the graph) are
  compiled; any other model is refused with a ``ValueError`` rather than guessed at
  (mixture-of-experts routing, Gemma's soft-caps and norms are not verified).
- Idempotent; reversible with ``uncompile_layers``. A sub-module that already has an
  instance-level ``forward`` from someone else (``polynya.fused``, accelerate's hooks) is refused.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .model_features import decoder_layers

_T = "transformers.models."
LAYER_CLASSES = (  # decoder layers whose children are self_attn, mlp and RMSNorms (5.17-5.24)
    _T + "llama.modeling_llama.LlamaDecoderLayer",
    _T + "qwen2.modeling_qwen2.Qwen2DecoderLayer",
    _T + "qwen3.modeling_qwen3.Qwen3DecoderLayer",
    _T + "mistral.modeling_mistral.MistralDecoderLayer",
)
_COMPILED: dict[tuple[type, str, bool], Callable] = {}  # (class, backend, dynamic) -> compiled call
_LOCK = threading.Lock()


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _call(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    """What ``torch.compile`` traces: a sub-module's own (bound) ``forward``."""
    return forward(*args, **kwargs)


def _compiled_call(cls: type, backend: str, dynamic: bool) -> Callable:
    """One compiled copy of ``_call`` per sub-module class (Dynamo keeps graphs and its
    recompile budget per code object, so classes do not evict each other's graphs)."""
    key = (cls, backend, dynamic)
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is None:
            copy = type(_call)(_call.__code__.replace(), _call.__globals__, _call.__name__)
            fn = _COMPILED[key] = torch.compile(copy, backend=backend, dynamic=dynamic)
    return fn


def _compiled_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward ``compile_layers`` installs: the class's own, through the compiled call."""
    step = self.__dict__["_polynya_compiled"]
    return step(type(self).forward.__get__(self), *args, **kwargs)


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
    name = _class_name(type(layers[0]))
    if name not in LAYER_CLASSES:
        return (f"compile_layers supports the decoder layers {', '.join(c.rsplit('.', 1)[1] for c in LAYER_CLASSES)}; "
                f"{name} is not verified (run without compiled layers)")
    for layer in layers:
        for child_name, child in layer.named_children():
            if "forward" in child.__dict__ and not _is_compiled(child):
                return (f"{type(child).__name__} {child_name!r} already has an instance-level forward "
                        "(polynya.fused, accelerate hooks, ...): compiled layers cannot wrap it")
    return None


def compile_layers(model: torch.nn.Module, *, backend: str = "inductor",
                   dynamic: bool = True) -> list[str]:
    """Route every decoder layer's sub-modules through ``torch.compile`` (module docstring).

    Args:
        model: an HF causal LM (or a module holding one: a DeepSpeed engine's ``module``).
        backend: ``torch.compile`` backend; ``"inductor"`` fuses kernels (the point), others
            (``"aot_eager"``) only check the plumbing.
        dynamic: compile with dynamic shapes (no recompile per new token count).
    Returns:
        The qualified names of the compiled sub-modules, in ``named_modules`` order.
    Raises:
        ValueError: the model is not one of ``LAYER_CLASSES``' families, or a sub-module already
            carries an instance-level forward; nothing is changed then.
    """
    if why := compile_reason(model):
        raise ValueError(why)
    if not isinstance(backend, str) or not isinstance(dynamic, bool):
        raise ValueError(f"backend must be a str and dynamic a bool, got {backend!r}, {dynamic!r}")
    layers, _ = decoder_layers(model)
    targets = {id(child) for layer in layers for child in layer.children()}
    names = []
    for name, module in model.named_modules():
        if id(module) not in targets:
            continue
        if not _is_compiled(module):
            module._polynya_compiled = _compiled_call(type(module), backend, dynamic)
            module.forward = functools.partial(_compiled_forward, module)
        names.append(name)
    return names


def uncompile_layers(model: torch.nn.Module) -> list[str]:
    """Undo ``compile_layers``; returns the names of the sub-modules restored (``[]`` if none)."""
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
    """The sub-modules of ``model`` that run compiled now."""
    return [name for name, module in model.named_modules() if _is_compiled(module)]

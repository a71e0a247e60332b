"""The decode forward compiled by ``torch.compile`` (Inductor) into fused kernels.

An eager HF decoder step launches ~50 small element-wise kernels per layer (RMSNorms, RoPE,
SiLU * mul, casts, residual adds); a CUDA graph removes their launch cost but not their
count. Compiled, Inductor fuses them around the GEMMs, and the result is captured into the
same ``DecodeGraphs`` buckets as the eager step (the compile runs on the warm-up calls before
the capture; replays run no Python at all).

What is compiled (``SamplerConfig.compile_scope``):

* ``"layers"`` (default, "regional compilation"): one decoder layer's forward. Every layer of
  the model runs the same code, Dynamo lifts the layer's parameters (and its layer index, a
  0-dim tensor: ``attention.tag_layers``) as graph inputs, so one graph serves every layer of
  a kind (same window, same attention path) and a compile traces one layer, not N. Each
  decoder layer's ``forward`` is routed (``Routes``, an instance attribute set once): a call
  carrying the compiled decode's context (``StepContext.cache``) goes through this runner's
  compiled layer function; prefill and scoring calls to the compiled prefill when there is one;
  every other call (the eager decode) runs the layer as before.
  The embedding, rotary, final norm and LM head run eagerly around the layers (inside the
  same CUDA graph: no Python at replay). Without CUDA graphs every layer call pays Dynamo's
  guard check and call wrapper (~0.1 ms each on the CPU), where the ``"model"`` scope pays it
  once per step;
* ``"model"``: the whole HF model's forward (may fuse across layer boundaries; ~N times the
  compile cost). Taken as well when the decoder layers cannot be found (``scope_reason``).

Either way the forest plan is built eagerly before the forward (inside the CUDA graph, as
before) and each layer's cache write + decode attention is one opaque ``torch.library`` op
(``attention.paged_decode_layer`` / ``fca_decode_layer``), so Dynamo never traces into the
Triton launchers. Prefill is not traced here: its shapes change every step (new prompt
lengths); with ``compile_prefill`` its layers run as dynamic-shape compiled regions around an
eager attention instead (``compiled_prefill.py``, through the same ``Routes``).

Compiles are bounded:

* one graph for every batch size: the batch dimension of every input (and of the plan's
  tensors) is marked dynamic; a batch of one is padded to two rows (the extra row decodes into
  the scratch page, like a CUDA-graph padding row) because torch specialises sizes 0 and 1;
* FCA and plain paged steps call different ops, so a runner compiles one graph per attention
  path (two), times the layer kinds in the ``"layers"`` scope (Gemma 2's windowed and full
  layers: four), plus whatever a guard failure costs, up to ``MAX_COMPILES`` per layer kind;
  past it, and while a CUDA graph is being captured, a recompile raises instead;
* any failure to compile (a graph break, an unsupported op, a limit hit: a Dynamo / Inductor
  error, or any error of a call that compiled) makes the runner decode eagerly from then on,
  with a ``RuntimeWarning`` saying why — never a crash and never different numbers. Any other
  error of a step — out of memory, the attention's own checks — is raised as the eager step
  would raise it, and the compiled step stays on.

Each runner compiles its own copy of the step (or layer) function (Dynamo keeps graphs and the
recompile limit per code object), so its graphs and its budget go with it. ``compiles`` / ``compile_s``
count its compiles and the wall seconds of the calls that compiled (Dynamo trace + Inductor +
the first run; Inductor's on-disk cache makes a repeat in a later process or runner cheaper).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from polynya.model_features import attention_features, decoder_layers
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

from . import attention

# per runner and layer kind: one graph per attention path under CUDA graphs (fixed block-table
# width); the graph-less path may add a specialisation for a one-block width and one per 2048
# tokens of context (FCA's slot count follows the width)
MAX_COMPILES = 8
# Dynamo's stance and config patches are process-wide, not per thread: compiled steps of
# several engines in one process (threads) run one at a time, so one engine's CUDA-graph
# capture stance or limits never apply to another's call nor are restored out of order. With
# CUDA graphs the compiled step runs only while a graph is captured (replays skip it).
_DYNAMO_SETTINGS = threading.RLock()
# Errors that mean "this cannot be compiled" wherever they come from (Dynamo's and Inductor's,
# and the recompile bound's, which is a plain Exception); any error of a call that compiled is one too.
COMPILE_ERRORS = (TorchDynamoException, FailOnRecompileLimitHit)


def _decode_step(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor,
                 ctx: attention.StepContext) -> torch.Tensor:
    """One decode forward; ``[B, V]`` logits. What ``torch.compile`` traces in the ``"model"``
    scope; in the ``"layers"`` scope it runs eagerly around the compiled layers."""
    out = model(input_ids=ids, position_ids=pos, use_cache=False, **{attention.CTX_KWARG: ctx})
    return out.logits[0]


def _decode_layer(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    """The function ``torch.compile`` traces in the ``"layers"`` scope: one decoder layer's
    own ``forward`` (a bound method: every layer's has the same function underneath and its
    module's parameters become graph inputs, so one graph serves every layer of a kind)."""
    return forward(*args, **kwargs)


@dataclass
class Routes:
    """Where routed decoder layers send their calls: the compiled decode step's (their context
    holds the whole cache) to ``decode`` (``(forward, *args, **kwargs)``), prefill calls to
    ``prefill`` (``compiled_prefill.CompiledPrefill``); None, and every other call: the layer's
    own forward. One object serves every layer of a model."""

    decode: Callable | None = None
    prefill: Callable | None = None


def _routed_forward(routes: Routes, layer: torch.nn.Module, forward: Callable, *args: Any,
                    **kwargs: Any) -> Any:
    """A routed decoder layer's ``forward`` (``Routes``)."""
    ctx = kwargs.get(attention.CTX_KWARG)
    if ctx is not None:
        if ctx.cache is not None and routes.decode is not None:
            _mark_layer_inputs(args, kwargs)
            return routes.decode(forward, *args, **kwargs)
        if ctx.is_prefill and routes.prefill is not None:
            return routes.prefill(layer, forward, args, kwargs)
    return forward(*args, **kwargs)


def routes_of(layers: torch.nn.ModuleList) -> Routes:
    """The ``Routes`` of ``layers``, routing each layer's ``forward`` (an instance attribute)
    on first use; the layer's own forward stays the one underneath."""
    first = layers[0].forward
    if isinstance(first, functools.partial) and first.func is _routed_forward:
        return first.args[0]
    routes = Routes()
    for layer in layers:
        # a partial of module-level functions (as polynya.fused): deepcopy keeps the pairing
        layer.forward = functools.partial(_routed_forward, routes, layer, layer.forward)
    return routes


def describe_failure(exc: BaseException) -> str:
    """``"Type: first line of the message"`` of a compile failure (what ``stats`` and the
    warnings report)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _own_copy(fn: Callable) -> Callable:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs, guards and the
    recompile budget per code object: with its own copy a runner's graphs and budget are its
    own and go with it (one shared function would collect every model's graphs of the
    process against one limit)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def pad_single_row(ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                   tables: torch.Tensor, lens: torch.Tensor, scratch_block: int,
                   block_size: int) -> tuple[torch.Tensor, ...]:
    """A batch of one plus one padding row (token 0 at position 0, written into the scratch
    page), all on the device: no host sync, capturable. Inference tensors exactly when the
    inputs are (CUDA-graph buffers are not; Dynamo guards on it: a mix would recompile)."""
    with torch.inference_mode(ids.is_inference()):
        pad_table = torch.zeros_like(tables[:1])
        pad_table[:, 0] = scratch_block
        return (torch.cat([ids, torch.zeros_like(ids)], dim=1),
                torch.cat([pos, torch.zeros_like(pos)], dim=1),
                torch.cat([slots, torch.full_like(slots, scratch_block * block_size)]),
                torch.cat([tables, pad_table]),
                torch.cat([lens, torch.ones_like(lens)]))


def _mark(t: torch.Tensor, dim: int, mark: Callable = torch._dynamo.mark_dynamic) -> None:
    """Mark ``t``'s ``dim`` dynamic, and the matching dim of the tensor it views (Dynamo
    builds a view input from its base)."""
    mark(t, dim)
    base = t._base
    if base is not None:
        for d in range(base.dim()):
            if base.shape[d] == t.shape[dim] and base.stride(d) == t.stride(dim):
                mark(base, d)
                break


def _mark_dynamic(ids: torch.Tensor, pos: torch.Tensor, ctx: attention.StepContext) -> None:
    """Every size that follows the batch is dynamic (one compile serves every bucket), and so
    is the block-table width, which only the eager (non-graph) path varies; a width of one
    block is specialised by torch (``maybe_mark_dynamic``): one more compile when it grows."""
    _mark(ids, 1)
    _mark(pos, 1)
    for t in (ctx.slot_mapping, ctx.block_tables, ctx.seq_lens):
        _mark(t, 0)
    _mark(ctx.block_tables, 1, torch._dynamo.maybe_mark_dynamic)
    plan = ctx.plan
    if plan is not None:
        for t in plan.work_tensors():
            if t is not plan.block_id_range and t is not plan.n_shared:
                _mark(t, 0)
        _mark(plan.pv_bt, 1, torch._dynamo.maybe_mark_dynamic)


def _mark_layer_inputs(args: tuple, kwargs: dict) -> None:
    """A decoder layer's batch-sized inputs, before each compiled layer call (each layer gets
    new hidden states): hidden states ``[1, B, H]``, the rotary ``(cos, sin)`` ``[1, B, D]``
    and ``position_ids`` ``[1, B]``, dim 1 each (the context's tensors are marked once per
    step). transformers passes no attention mask to this attention (its mask functions do not
    know it); a mask tensor would stay static (a recompile per batch size, then the limit)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    for t in (hidden, kwargs.get("position_ids"), *(kwargs.get("position_embeddings") or ())):
        if isinstance(t, torch.Tensor):
            _mark(t, 1)


class CompiledDecode:
    """The compiled decode step of one model runner, with its eager fallback.

    Args:
        model: the HF model (``attn_implementation="polynya_paged"``).
        context: ``(slots, block_tables, seq_lens, fca) -> StepContext`` over the whole cache
            (plans FCA when ``fca``).
        eager: the eager decode step ``(ids, pos, slots, tables, lens, fca) -> logits``.
        scratch_block / block_size: the page padding rows write into.
        name: how warnings name the model.
        scope: ``"layers"`` or ``"model"`` (module docstring); ``self.scope`` is the one taken
            and ``self.scope_reason`` says why it is not the one asked for (else None).
        fuse_projections: run linears on one input as one GEMM (the model's weights fused by
            ``fused_projections.ProjectionGroups``); ``fused_calls`` counts the groups made.
    """

    def __init__(self, model: torch.nn.Module, context: Callable[..., attention.StepContext],
                 eager: Callable[..., torch.Tensor], scratch_block: int, block_size: int,
                 name: str, scope: str = "layers", fuse_projections: bool = False) -> None:
        self.model, self.context, self.eager = model, context, eager
        self.fuse_projections = fuse_projections
        self.fused_calls = 0  # linear groups made one GEMM (fused_projections.py), all graphs
        self.scratch_block, self.block_size, self.name = scratch_block, block_size, name
        self.compiles = 0
        self.compile_s = 0.0
        self.error: str | None = None  # why decode runs eagerly
        self._step: Callable | None = None  # made on first use (importing Dynamo costs seconds)
        attention.tag_layers(model)
        self.scope, self.scope_reason = scope, None
        self._layers, self.layer_kinds = None, 1
        if scope == "layers":
            self._layers, self.scope_reason = decoder_layers(model)
            if self._layers is None:
                self.scope = "model"
            else:  # a graph per (layer kind, path): the compile budget grows with the kinds
                self.layer_kinds = len(set(attention_features(model).layer_windows))

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """The backend: Inductor, counted; with ``fuse_projections`` the graph's linears on
        one input first become one GEMM (``fused_projections.fuse_linear_calls``)."""
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        if self.fuse_projections:
            from .fused_projections import fuse_linear_calls

            self.fused_calls += fuse_linear_calls(gm)
        return compile_fx(gm, example_inputs)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, fca: bool) -> torch.Tensor:
        """One decode step (same arguments and result as the eager step)."""
        if self.error is not None:
            return self.eager(ids, pos, slots, tables, lens, fca)
        batch = ids.shape[1]
        # [1, B] rows re-viewed with stride (B, 1) as a padded row has: Dynamo guards on it
        args = (ids[0][None], pos[0][None], slots, tables, lens)
        if batch == 1:
            args = pad_single_row(*args, self.scratch_block, self.block_size)
        ctx = self.context(*args[2:], fca)
        _mark_dynamic(args[0], args[1], ctx)
        before, start = self.compiles, time.perf_counter()
        try:
            if self._step is None:
                self._step = self.make_step()
            with _DYNAMO_SETTINGS, self._limits():
                return self._step(self.model, args[0], args[1], ctx)[:batch]
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if not isinstance(exc, COMPILE_ERRORS) and self.compiles == before:
                raise  # the step's own error (the attention's checks, a kernel's), as eager raises it
            failure = describe_failure(exc)  # the message only: the traceback's tensors are freed
        finally:
            if self.compiles != before:
                self.compile_s += time.perf_counter() - start
        self._fail(failure)
        return self.eager(ids, pos, slots, tables, lens, fca)  # this step again, eagerly

    def make_step(self) -> Callable:
        """The step ``(model, ids, pos, ctx) -> [B, V] logits``: this runner's compiled copy of
        ``_decode_step`` (``"model"``), or ``_decode_step`` itself over decoder layers routed to
        this runner's compiled copy of ``_decode_layer`` (``"layers"``)."""
        compile_ = functools.partial(torch.compile, backend=self._inductor, fullgraph=True,
                                     dynamic=None)
        if self._layers is None:
            return compile_(_own_copy(_decode_step))
        routes_of(self._layers).decode = compile_(_own_copy(_decode_layer))
        return _decode_step

    def _limits(self) -> contextlib.ExitStack:
        """Recompiles raise (rather than run eagerly unnoticed, or compile per step) past
        ``MAX_COMPILES`` per layer kind (Dynamo's limit on this runner's code object) and
        during a CUDA-graph capture, where a compile cannot run; sizes not marked dynamic stay
        static."""
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.compiler.set_stance("fail_on_recompile" if capturing else "default"))
        stack.enter_context(torch._dynamo.config.patch(
            recompile_limit=MAX_COMPILES * self.layer_kinds, fail_on_recompile_limit_hit=True,
            automatic_dynamic_shapes=False))
        return stack

    def _fail(self, failure: str) -> None:
        self.error = failure
        warnings.warn(f"{self.name}: the decode step cannot be compiled ({self.error}); decoding "
                      "with the eager model from now on (set compile_decode=False to silence)",
                      RuntimeWarning, stacklevel=4)


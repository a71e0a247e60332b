"""Paged attention for HF models, plugged in through transformers' ``AttentionInterface``.

``register()`` adds ``"polynya_paged"`` to ``AttentionInterface``; a model loaded with
``attn_implementation="polynya_paged"`` then calls :func:`paged_attention` in every layer with
its projected, rotated ``query/key/value``. The model runner passes the step's
:class:`StepContext` through the model's ``**kwargs`` (key ``polynya_ctx``); nothing in the
model class is patched.

The model sees one packed row ``[1, T]`` per step (all sequences' new tokens back to back, with
their true ``position_ids``). Per layer the function

1. writes the new keys/values into the paged cache at ``ctx.slot_mapping``;
2. prefill: for each sequence, causal SDPA of its new queries over its whole context (cached
   prefix pages + the new tokens, read back through its block table);
   decode: one query per sequence through ``polynya.kernels.fca`` — ``fca_decode`` with the
   forest plan built once per step (``ctx.plan``), or ``paged_decode`` when FCA is off or no
   two sequences of the step share a page.

The compiled decode (``compiled.py``) passes the whole cache in ``StepContext.cache``; steps 1-2
then run as one ``torch.library`` custom op per layer (``paged_decode_layer`` /
``fca_decode_layer``, declared to mutate the cache), opaque to ``torch.compile``. Nothing of that
branch reads a layer's Python ``layer_idx`` (Dynamo would guard on the int: one graph per layer):
the op takes the layer as the 0-dim tensor ``tag_layers`` gives each attention module, and the
window as the model passes it — so one compiled decoder layer serves every layer of its kind
(``compile_scope="layers"``) and a whole-model compile (``"model"``) works the same.

What the model's attention needs (``polynya.model_features``) is honoured per layer: a
sliding-window layer's prefill masks keys more than ``W - 1`` positions back and its decode
reads only the last ``W`` positions through ``paged_decode`` (FCA's shared nodes are not
windowed, so windowed layers skip FCA; full layers of the same step keep it); a soft-cap
(Gemma 2) runs the prefill through ``eager_attention`` and the decode kernels' ``softcap``.

Because step 1 runs for all sequences before step 2, a sequence may read pages that another
sequence of the same prefill writes (two identical prompts in one batch share their pages).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from polynya.eager_attention import causal_mask, eager_attention
from polynya.kernels.fca import DecodeConfig, ForestPlan, fca_decode, paged_decode
from polynya.kernels.zorro.varlen import unsupported_reason as varlen_unsupported_reason
from polynya.model_features import SOFTCAP, WINDOWS, AttentionFeatures
from torch.nn.attention import SDPBackend, sdpa_kernel

NAME = "polynya_paged"
CTX_KWARG = "polynya_ctx"
LAYER_ATTR = "polynya_layer"  # an attention module's layer index as a 0-dim int64 CPU tensor
SUPPORTS = frozenset({WINDOWS, SOFTCAP})  # model features the native sampler implements


@dataclass
class StepContext:
    """Everything a layer needs to attend over the paged cache for one step.

    Args:
        kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hkv, D]``.
        slot_mapping: ``[T]`` int64 flat cache slot (``block * block_size + offset``) per new token;
            None for a scoring pass (prompt log-probs: a prefill with nothing cached, whose keys
            and values are not kept; ``kv_caches`` is then unused).
        is_prefill: prefill step (many tokens per sequence) or decode step (one per sequence).
        q_ranges: prefill: per sequence ``(start, end)`` of its new tokens in the packed row.
        cached_lens: prefill: per sequence, tokens already in the cache before this step.
        prefill_tables: prefill: per sequence ``[n_blocks]`` int64 block ids (device), or None
            when nothing of it is cached (its new keys are then its whole context).
        block_tables: decode: ``[B, max_blocks]`` int32. seq_lens: decode: ``[B]`` int32 KV length.
        plan: decode with FCA: the ``ForestPlan`` of this step (shared by every layer).
        fca_shared_progs_per_sm: FCA's shared-pass programs per SM
            (``SamplerConfig.fca_shared_progs_per_sm``); None: the kernel's default.
        features: the model's attention features (per-layer windows); None = all full.
        cache: the compiled decode (``compiled.py``): the whole cache
            ``[layers, 2, num_blocks, block_size, Hkv, D]`` (``kv_caches`` is then empty);
            each layer's cache write and attention run as one opaque op that mutates it.
        varlen: prefill on CUDA: every sequence's attention in one varlen call per layer
            (:class:`PrefillVarlen`); None runs one SDPA call per sequence.
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor | None
    is_prefill: bool
    q_ranges: list[tuple[int, int]] = field(default_factory=list)
    cached_lens: list[int] = field(default_factory=list)
    prefill_tables: list[torch.Tensor | None] = field(default_factory=list)
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    plan: Any = None
    fca_shared_progs_per_sm: int | None = None
    features: AttentionFeatures | None = None
    cache: torch.Tensor | None = None
    varlen: PrefillVarlen | None = None


@dataclass
class PrefillVarlen:
    """A prefill's sequences as FlashAttention-2 varlen segments (built once per step).

    Args:
        cu_q: ``[S + 1]`` int32, cumulative new-token counts (the packed row's segments).
        cu_k: ``[S + 1]`` int32, cumulative context lengths (cached + new tokens).
        max_q / max_k: the longest segment of each.
        kv_slots: ``[cu_k[-1]]`` int64 flat cache slots of every sequence's whole context, in
            order (read back after the step's keys are written); None when nothing is cached
            (each context is then its own new tokens: the keys are used as computed).
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    kv_slots: torch.Tensor | None


def prefill_varlen(new_lens: list[int], cached_lens: list[int], context_slots, to_device
                   ) -> PrefillVarlen:
    """:class:`PrefillVarlen` of sequences with ``new_lens`` new tokens after ``cached_lens``
    cached ones; ``context_slots()`` gives the host array of every context's flat slots (called
    only when something is cached); ``to_device(array, dtype)`` copies a host array over."""
    new = np.asarray(new_lens, dtype=np.int64)
    ctx = new + np.asarray(cached_lens, dtype=np.int64)
    cu = np.zeros((2, len(new) + 1), dtype=np.int64)
    np.cumsum(new, out=cu[0, 1:])
    np.cumsum(ctx, out=cu[1, 1:])
    cu_dev = to_device(cu, torch.int32)
    slots = to_device(context_slots(), torch.int64) if any(cached_lens) else None
    return PrefillVarlen(cu_dev[0], cu_dev[1], int(new.max()), int(ctx.max()), slots)


def register() -> None:
    """Make ``attn_implementation="polynya_paged"`` available (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention)


def tag_layers(model: torch.nn.Module) -> int:
    """Give every module of ``model`` with an int ``layer_idx`` (the attention modules) its
    index as a 0-dim int64 CPU tensor ``LAYER_ATTR``, which the compiled decode's ops take.
    A plain attribute (not a buffer: ``state_dict``, ``.to()`` and the weight checksums never
    see it); Dynamo lifts it as a graph input, so layers differ in a tensor's value, not in a
    guard. Idempotent; returns how many modules were tagged."""
    tagged = 0
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool):
            setattr(module, LAYER_ATTR, torch.tensor(idx, dtype=torch.int64))
            tagged += 1
    return tagged


def _layer_tensor(module: torch.nn.Module) -> torch.Tensor:
    layer = getattr(module, LAYER_ATTR, None)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} has no {LAYER_ATTR!r} (tag_layers): the "
                           "compiled decode cannot tell which layer's cache it writes")
    return layer


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function.

    Args:
        query: ``[1, Hq, T, D]``; key, value: ``[1, Hkv, T, D]`` (after RoPE).
        kwargs: must hold ``polynya_ctx`` (:class:`StepContext`).
    Returns:
        ``([1, T, Hq, D], None)``.
    """
    ctx: StepContext | None = kwargs.get(CTX_KWARG)
    if ctx is None:
        raise RuntimeError(f"attention {NAME!r} needs a StepContext in kwargs[{CTX_KWARG!r}]; "
                           "run the model through polynya's ModelRunner")
    if kwargs.get("s_aux") is not None:
        raise ValueError("the native sampler does not implement attention sinks")
    softcap = kwargs.get("softcap")
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if ctx.cache is not None:  # compiled decode: cache write + attention as one opaque op
        # the window as the model passes it: the layer's prefill (eager, before any decode of
        # it) checked it against the config; no Python layer index in traced code
        return _decode_op(q, k, v, ctx, _layer_tensor(module), scaling,
                          kwargs.get("sliding_window"), softcap).unsqueeze(0), None
    window = (ctx.features.check_call(module.layer_idx, kwargs) if ctx.features is not None
              else kwargs.get("sliding_window"))
    k_cache = v_cache = None
    if ctx.slot_mapping is not None:  # None: a scoring pass, which neither reads nor writes pages
        k_cache, v_cache = ctx.kv_caches[module.layer_idx]
        write_kv(k_cache, v_cache, ctx.slot_mapping, k, v)
    if ctx.is_prefill:
        out = _prefill(q, k, v, k_cache, v_cache, ctx, scaling, window, softcap)
    else:
        out = _decode(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx.plan, scaling,
                      window, softcap, ctx.fca_shared_progs_per_sm)
    return out.unsqueeze(0), None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store new keys / values ``[T, Hkv, D]`` at flat cache slots ``[T]``."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))


# Prefill SDPA backends on CUDA: cuDNN is left out because it builds an execution plan for every
# new (query, key) length — RL prompts bring new lengths every step, and each build costs tens to
# hundreds of ms (seen as 1.8-3.9 s prefills of 8 prompts on an H200); flash / memory-efficient
# attention take any length with no per-shape setup.
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, ctx: StepContext, scale: float | None,
             window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal (windowed) attention of each sequence's new tokens over its full context;
    ``[T, Hq, D]``. On CUDA one varlen call for every sequence when the kernel takes the
    inputs (bf16 / fp16, no soft-cap), else one SDPA call per sequence."""
    if ctx.varlen is not None and softcap is None and _varlen_takes(q, k, k_cache):
        return _prefill_varlen(q, k, v, k_cache, v_cache, ctx.varlen, scale, window)
    if q.device.type == "cuda":
        with sdpa_kernel(_PREFILL_BACKENDS):
            return _prefill_each(q, k, v, k_cache, v_cache, ctx, scale, window, softcap)
    return _prefill_each(q, k, v, k_cache, v_cache, ctx, scale, window, softcap)


def _varlen_takes(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor | None) -> bool:
    """Whether FlashAttention-2 varlen runs this prefill (CUDA, bf16 / fp16, cache of the
    same dtype, head dim it supports, flash SDPA enabled)."""
    if not q.is_cuda or (k_cache is not None and k_cache.dtype != q.dtype):
        return False
    return varlen_unsupported_reason(q, k) is None


def _prefill_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                    segs: PrefillVarlen, scale: float | None, window: int | None) -> torch.Tensor:
    """Every sequence's new queries over its context in one FlashAttention-2 varlen call:
    causal aligned to the bottom right (a sequence's queries are the last of its keys), a
    window of ``W`` keeping keys less than ``W`` positions back; ``[T, Hq, D]``."""
    if segs.kv_slots is not None:  # cached prefixes: read every context back from the pages
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        k = k_cache.view(-1, hkv, d).index_select(0, segs.kv_slots)
        v = v_cache.view(-1, hkv, d).index_select(0, segs.kv_slots)
    left = None if window is None else window - 1
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, segs.cu_q, segs.cu_k, segs.max_q, segs.max_k, 0.0, True, False,
        scale=scale if scale is not None else q.shape[-1] ** -0.5, window_size_left=left,
        window_size_right=None if left is None else 0)[0]
    return out


def _prefill_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, ctx: StepContext, scale: float | None,
                  window: int | None, softcap: float | None) -> torch.Tensor:
    out = torch.empty_like(q)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    for (start, end), cached, table in zip(ctx.q_ranges, ctx.cached_lens, ctx.prefill_tables):
        qi = q[start:end].transpose(0, 1)[None]  # [1, Hq, L, D]
        total = cached + end - start
        if cached == 0:  # nothing cached: the new keys are the whole context
            ki, vi = k[start:end], v[start:end]
        else:
            ki = k_cache[table].flatten(0, 1)[:total]
            vi = v_cache[table].flatten(0, 1)[:total]
        ki, vi = (x.transpose(0, 1)[None].to(q.dtype) for x in (ki, vi))
        w = window if window is not None and total > window else None  # else a no-op
        if softcap is not None:
            oi = eager_attention(qi, ki, vi, causal_mask(end - start, total, q.device, w),
                                 scale, softcap)
        elif cached == 0 and w is None:
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                enable_gqa=True)
        else:
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=causal_mask(end - start, total, q.device, w),
                scale=scale, enable_gqa=True)
        out[start:end] = oi[0].transpose(0, 1)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, plan: ForestPlan | None,
            scale: float | None, window: int | None = None,
            softcap: float | None = None,
            shared_progs_per_sm: int | None = None) -> torch.Tensor:
    """One query per sequence over its pages (its last ``window`` positions in a windowed
    layer, which takes the paged path); ``[B, Hq, D]``."""
    # block tables come from the block manager (valid by construction): skip the host-syncing
    # value checks so neither path stalls the GPU once per layer
    q = q.contiguous()
    if plan is not None and window is None:
        return fca_decode(q, k_cache, v_cache, plan, scale=scale, validate=False,
                          softcap=softcap, config=_fca_config(shared_progs_per_sm))
    return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                        validate=False, softcap=softcap, window=window)


@functools.lru_cache(maxsize=8)
def _fca_config(shared_progs_per_sm: int | None) -> DecodeConfig:
    """The kernel's defaults with the sampler's shared-pass programs per SM (None: theirs)."""
    return DecodeConfig(shared_progs_per_sm=shared_progs_per_sm)


# ---------------------------------------------------------------- the compiled decode's ops
# ``torch.compile`` sees each layer's cache write + decode attention as one op: Dynamo does not
# trace into the Triton launchers, the plan or the cache layout; the op declares that it writes
# the cache (and FCA's scheduler counters), and its fake implementation gives the output's
# shape. The forest plan travels as its tensors (``ForestPlan.work_tensors``).


@torch.library.custom_op("polynya::paged_decode_layer", mutates_args=("cache",))
def paged_decode_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                       layer: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, scale: float | None, window: int | None,
                       softcap: float | None) -> torch.Tensor:
    """Write layer ``layer``'s new keys / values ``[B, Hkv, D]`` into ``cache`` (the whole
    ``[layers, 2, ...]`` cache) and attend ``q [B, Hq, D]`` over the pages; ``[B, Hq, D]``.
    ``layer``: 0-dim CPU tensor (``tag_layers``), read on the host (no device sync)."""
    k_cache, v_cache = cache[int(layer)]  # [2, ...]: this layer's keys, values
    write_kv(k_cache, v_cache, slots, k, v)
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, None, scale, window,
                   softcap).contiguous()


@torch.library.custom_op("polynya::fca_decode_layer", mutates_args=("cache", "counters"))
def fca_decode_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                     layer: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, work: list[torch.Tensor], counters: torch.Tensor,
                     max_shared_slots: int, scale: float | None,
                     softcap: float | None, shared_progs_per_sm: int | None) -> torch.Tensor:
    """``paged_decode_layer`` through FCA with the step's plan (``ForestPlan.work_tensors``
    and its ``counters``, which the kernels use and reset)."""
    k_cache, v_cache = cache[int(layer)]  # [2, ...]: this layer's keys, values
    write_kv(k_cache, v_cache, slots, k, v)
    plan = ForestPlan.from_tensors(block_tables, seq_lens, cache.shape[3], max_shared_slots,
                                   work, counters)
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, plan, scale, None,
                   softcap, shared_progs_per_sm).contiguous()


@paged_decode_layer.register_fake
def _(q, k, v, cache, layer, slots, block_tables, seq_lens, scale, window, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@fca_decode_layer.register_fake
def _(q, k, v, cache, layer, slots, block_tables, seq_lens, work, counters, max_shared_slots,
      scale, softcap, shared_progs_per_sm):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
               layer: torch.Tensor, scale: float | None, window: int | None,
               softcap: float | None) -> torch.Tensor:
    """One layer of the compiled decode: FCA's op for full-attention layers of an FCA step,
    the paged op otherwise (windowed layers read only their window)."""
    plan = ctx.plan
    if plan is not None and window is None:
        return fca_decode_layer(q, k, v, ctx.cache, layer, ctx.slot_mapping, plan.block_tables,
                                plan.seq_lens, list(plan.work_tensors()), plan.counters,
                                plan.max_shared_slots, scale, softcap,
                                ctx.fca_shared_progs_per_sm)
    return paged_decode_layer(q, k, v, ctx.cache, layer, ctx.slot_mapping, ctx.block_tables,
                              ctx.seq_lens, scale, window, softcap)


"""ZoRRo attention, hooked into any HF decoder through transformers' ``AttentionInterface``.

``use_zorro_attention(model)`` switches the model to the ``"polynya"`` implementation. It behaves
like ``"sdpa"`` (same mask creation, same kernel; ``eager_attention`` for a call that carries a
soft-cap, which SDPA cannot apply) for every ordinary call — generation, padded batches — and
only differs when the model is handed a ZoRRo mask.

That mask is a ``ZorroMask`` (``mask.py``) that carries the forest and gives each layer what
its path needs — the layer's sliding window (``polynya.model_features``, by ``module.layer_idx``
and cross-checked against the ``sliding_window`` the model passes) and soft-cap (the ``softcap``
the model passes) included:

- on CPU a dense ``[R, 1, L, L]`` bool mask, passed to SDPA, or to ``eager_attention`` for a
  soft-capped layer (FlexAttention has no CPU backward);
- on GPU a *split* plan
  (``polynya.kernels.zorro``: one cuDNN call per shared node — a prompt's keys read once for the
  prompt and all its responses — one batched call over the responses, exact log-sum-exp merge)
  and, built only when used, a FlexAttention ``BlockMask`` of the same rule (fully visible
  blocks run unmasked, invisible ones are skipped; the window joins ``mask_mod``, the soft-cap is
  a ``score_mod``). Windowed and soft-capped layers always run FlexAttention (the cuDNN calls
  take neither); for the other layers ``attention="auto"`` takes the split path
  when its kernels can (bf16 / fp16, head dim <= 128) and it pays (``_split_pays``: long shared
  prefixes, at most ``MAX_INNER`` shared nodes), FlexAttention otherwise (fp32, short prompts
  with long responses, deep multi-turn forests); ``"split"`` / ``"flex"`` force one.

A forest of leaves only — the packed naive layout (``compute_logprobs(..., zorro=False)``, every
sample its own causal segment, no padding, as verl's remove-padding runs it) or a ZoRRo batch
that shares nothing — needs no mask at all: on GPU its full-attention layers run either one
FlashAttention-2 varlen call over the segment boundaries (``polynya.kernels.zorro.varlen``:
no work on padding) or split attention's cuDNN call over the padded batch of segments (faster
per FLOP on Hopper; ``_leaf_batch_pays`` picks it for long segments of near-equal lengths;
shorter ones ran faster as varlen in a whole step), ``"varlen"`` / ``"split"`` force one (bf16 / fp16); its windowed
and soft-capped layers FlexAttention as above; on CPU each segment runs SDPA (``eager_attention`` when soft-capped) on its own (cost of
the padded layout, not of a dense mask over all packed tokens).

The visibility rule (see ``tree.py`` and ``mask.py``): key ``j`` is visible from query ``i``
iff ``tin[j] <= tin[i] and tout[i] <= tout[j] and j <= i`` (and, in a layer with window ``W``,
``pos[i] - pos[j] < W``). Attention sinks (gpt-oss) are refused at load time
(``compute_logprobs`` checks ``ZORRO_SUPPORTS``).
No model class is patched; the mask travels as the model's ordinary ``attention_mask``, so it
is also there when gradient checkpointing recomputes a layer in the backward pass.

cuDNN builds an execution plan for every new problem shape (~85 ms for forward + backward on an
H200), and RL batches bring new prompt and response lengths every step. ``import polynya``
therefore sets torch's ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` unless the environment already
says otherwise: cuDNN then reuses plans across lengths rounded up to powers of two. torch reads
the switch once, at the process's first cuDNN attention call (so import polynya first; set it to
``0`` to keep torch's default).
"""
from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..config.common import check_zorro_attention
from ..dynamo import fresh_function
from ..eager_attention import causal_mask, eager_attention
from ..kernels.zorro import MAX_INNER, split_attention, varlen_attention
from ..model_features import SOFTCAP, WINDOWS, AttentionFeatures
from .mask import FLEX_BLOCK, ZorroMask, _leaf_batch_pays, _split_pays, dense_mask, interval_block_mask

__all__ = ["FLEX_BLOCK", "MAX_INNER", "NAME", "ZORRO_SUPPORTS", "ZorroMask", "_leaf_batch_pays",
           "_split_pays", "dense_mask", "interval_block_mask", "polynya_attention_forward",
           "use_zorro_attention", "zorro_mask"]

NAME = "polynya"
ZORRO_SUPPORTS = frozenset({WINDOWS, SOFTCAP})  # model features ZoRRo Train implements

# compiled FlexAttention per configuration (flex_key), most recently used last
_COMPILED_FLEX: OrderedDict[tuple, Callable] = OrderedDict()
_FLEX_CONFIGS = 32
_FLEX_LOCK = threading.Lock()


def flex_key(query, key, block_mask, scale, softcap) -> tuple:
    """What Dynamo specialises a FlexAttention call on, besides lengths (which turn dynamic
    after the first new one): device, dtype, heads, head dim, scale, soft-cap, grad mode, the
    mask function's code and its non-tensor captures (a layer's window)."""
    mod = block_mask.mask_mod
    cells = tuple(_capture_key(c.cell_contents) for c in (getattr(mod, "__closure__", None) or ())
                  if not isinstance(c.cell_contents, torch.Tensor))
    return (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1],
            float(scale), softcap, torch.is_grad_enabled(), getattr(mod, "__code__", mod), cells,
            block_mask.BLOCK_SIZE)


def _capture_key(value):
    """A captured value as a key: functions by their code (a new closure of the same code per
    call must not compile anew), other hashable values as they are, the rest by type."""
    if callable(value) and hasattr(value, "__code__"):
        return value.__code__
    try:
        hash(value)
    except TypeError:
        return type(value)
    return value


def compiled_flex(config: tuple) -> Callable:
    """``torch.compile(flex_attention)`` for one ``flex_key``: each configuration compiles its own
    copy of the function (``fresh_function``), so a process that meets many configurations
    (several models, dtypes or window sizes) never spends one shared recompile budget, past which
    Dynamo would run FlexAttention eagerly — its unfused reference that materialises every score
    — without an error. The ``_FLEX_CONFIGS`` most recently used stay compiled."""
    with _FLEX_LOCK:
        fn = _COMPILED_FLEX.get(config)
        if fn is None:
            from torch.nn.attention.flex_attention import flex_attention

            fn = _COMPILED_FLEX[config] = torch.compile(fresh_function(flex_attention))
            if len(_COMPILED_FLEX) > _FLEX_CONFIGS:
                _COMPILED_FLEX.popitem(last=False)
        _COMPILED_FLEX.move_to_end(config)
        return fn


FLEX_MIN_HEAD_DIM = 16  # FlexAttention's CUDA kernels (tl.dot) take no smaller head dim


def check_flex_head_dim(head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
    """``ValueError`` before FlexAttention on CUDA meets a head dim it cannot run (torch would
    raise a ``NotImplementedError`` from inside its compiler)."""
    if torch.device(device).type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM:
        raise ValueError(
            f"head dim {head_dim} is below {FLEX_MIN_HEAD_DIM}, the smallest FlexAttention runs "
            f"on CUDA, which polynya's packed layouts use for this call ({dtype}); run this "
            "model with zorro=False, naive_layout='padded'")


def _flex(query, key, value, block_mask, scale, softcap=None):
    check_flex_head_dim(min(query.shape[-1], value.shape[-1]), query.device, query.dtype)
    fn = compiled_flex(flex_key(query, key, block_mask, scale, softcap))
    return fn(query, key, value, score_mod=softcap_score_mod(softcap), block_mask=block_mask,
              scale=scale, enable_gqa=query.shape[1] != key.shape[1])


@functools.lru_cache(maxsize=16)
def softcap_score_mod(softcap: float | None):
    """FlexAttention ``score_mod`` of a soft-cap (``c * tanh(score / c)``), or None; one function
    object per cap, so the compiled FlexAttention is not re-traced on every call."""
    if softcap is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)
    return score_mod


def _ordinary(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """Any call without a ZoRRo mask (generation, padded batches): what SDPA would do, through
    ``eager_attention`` where SDPA cannot (a soft-cap)."""
    if kwargs.get("s_aux") is not None:
        raise ValueError("the 'polynya' attention does not implement attention sinks; load the "
                         "model with attn_implementation='eager'")
    softcap = kwargs.get("softcap")
    if softcap is None or isinstance(attention_mask, BlockMask):
        if isinstance(attention_mask, BlockMask):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return _flex(query, key, value, attention_mask, scale, softcap).transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    mask = attention_mask
    if mask is None and getattr(module, "is_causal", True):
        mask = causal_mask(query.shape[2], key.shape[2], query.device, kwargs.get("sliding_window"))
    elif mask is not None and mask.dtype != torch.bool:
        mask = mask == 0  # an additive float mask: 0 where visible
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = eager_attention(query, key, value, mask, scale, softcap)
    return out.transpose(1, 2).contiguous(), None


def polynya_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs):
    """query ``[b, Hq, L, D]``, key/value ``[b, Hkv, L, D]`` -> (``[b, L, Hq, D]``, None).

    Traced by ``torch.compile`` (a user's ``torch.compile(model)``; ``polynya.compiled_layers``
    calls it outside its regions) it leaves the graph: the call runs eagerly, plans and all."""
    if torch.compiler.is_compiling():
        return _outside_graph(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if not isinstance(attention_mask, ZorroMask):
        return _ordinary(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if kwargs.get("s_aux") is not None:
        raise ValueError("ZoRRo does not implement attention sinks; call "
                         "compute_logprobs(..., zorro=False) for this model")
    feats: AttentionFeatures | None = attention_mask.features
    layer = getattr(module, "layer_idx", None)
    window = feats.check_call(layer, kwargs) if feats is not None else kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.device.type != "cuda":
        if attention_mask.segments:
            return _segments_eager(query, key, value, attention_mask.bounds(), scale, window, softcap), None
        mask = attention_mask.dense(window)
        if softcap is None:
            return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                          scaling=scale)
        return eager_attention(query, key, value, mask, scale, softcap).transpose(1, 2).contiguous(), None
    if window is None and softcap is None:
        b, hq, length, d = query.shape
        flat = (lambda x: x.transpose(1, 2).reshape(b * length, x.shape[1], d))
        plan = attention_mask.split_plan(query, key)
        if plan is not None:
            out = split_attention(flat(query), flat(key), flat(value), plan, scale)
            return out.view(b, length, hq, d), None
        varlen = attention_mask.varlen_plan(query, key)
        if varlen is not None:
            out = varlen_attention(flat(query), flat(key), flat(value), *varlen, scale)
            return out.view(b, length, hq, d), None
    out = _flex(query, key, value, attention_mask.flex_mask(window), scale, softcap)
    return out.transpose(1, 2).contiguous(), None


_outside_graph = torch.compiler.disable(polynya_attention_forward)


def _segments_eager(query, key, value, bounds, scale: float, window: int | None,
                    softcap: float | None) -> torch.Tensor:
    """CPU attention of packed segments: each segment causal on its own (``bounds`` flat over
    ``[R * L]``, none crossing a row). ``[R, H, L, D]`` in, ``[R, L, H, D]`` out."""
    rows, heads, length, dim = query.shape
    gqa = heads != key.shape[1]
    outs = []
    for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        r, a, n = s // length, s % length, e - s
        q, k, v = (x[r:r + 1, :, a:a + n] for x in (query, key, value))
        if softcap is not None:
            outs.append(eager_attention(q, k, v, causal_mask(n, n, query.device, window), scale, softcap))
        elif window is not None:
            outs.append(F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_mask(n, n, query.device, window), scale=scale, enable_gqa=gqa))
        else:
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, 2).view(heads, rows, length, dim).permute(1, 2, 0, 3).contiguous()


AttentionInterface.register(NAME, polynya_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_zorro_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (and its sub-configs) to the ``"polynya"`` attention; idempotent."""
    if getattr(model.config, "_attn_implementation", None) == NAME:
        return
    try:
        model.set_attn_implementation(NAME)
    except (AttributeError, ValueError, ImportError):
        model.config._attn_implementation = NAME


def zorro_mask(tin: torch.Tensor, tout: torch.Tensor, nodes=None, attention: str = "auto",
               position_ids: torch.Tensor | None = None,
               features: AttentionFeatures | None = None) -> ZorroMask:
    """The attention mask of packed rows (a ``ZorroMask``; ``.dense()`` is the bool form).

    Args:
        tin, tout: ``[R, L]`` int32 preorder intervals of each token's node.
        nodes: ``PackedRows.nodes`` (the split / varlen plans' input); None = FlexAttention only.
            Plans and FlexAttention block masks are built lazily, by the first layer.
        attention: ``"auto"`` / ``"split"`` / ``"flex"`` / ``"varlen"`` (module docstring); CPU
            ignores it.
        position_ids: ``[R, L]`` the tokens' positions; features: the model's
            ``AttentionFeatures`` (per-layer windows). Both needed for windowed models.
    """
    check_zorro_attention(attention, "compute_logprobs")
    if attention in ("split", "varlen") and nodes is None and tin.device.type == "cuda":
        raise ValueError(f"zorro_attention={attention!r} needs the packed rows' node table")
    if features is not None and features.windowed and position_ids is None:
        raise ValueError("a model with sliding-window layers needs the rows' position_ids")
    return ZorroMask(tin, tout, nodes, attention, position_ids, features)

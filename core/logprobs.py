"""The one log-prob / entropy function every polynya engine uses.

``compute_logprobs(model, batch)`` returns, for each response token, its log-probability (and
optionally the entropy of the predictive distribution) under ``model`` at a given temperature.
With ``zorro=True`` the batch's shared prefixes are computed once (``polynya.zorro``); with
``zorro=False`` every sample is computed on its own, prompt included, in one of two layouts:
``"packed"`` — all samples back to back without padding, each its own causal segment with its
own positions (verl's remove-padding; FlashAttention-2 varlen or cuDNN on GPU), the strongest baseline a
user runs without polynya — or ``"padded"`` — one right-padded row per sample under the model's
own attention (the plain reference, and the only layout for attention features the packed one
does not implement, e.g. gpt-oss's sinks). ``"auto"`` (default) is packed where it can honour
the model, else padded. All paths then
share the same head: the hidden states that predict response tokens are gathered and pushed
through the LM head in chunks of tokens (``polynya.head``), each chunk recomputed in the
backward pass, so the full ``[tokens, vocab]`` logits never exist at once.
"""
from __future__ import annotations

import numpy as np
import torch

from .head import token_stats
from .model_features import AttentionFeatures, attention_features, model_name, text_config
from .types import RolloutBatch, TokenStats
from .zorro import pack_rows
from .config.common import check_naive_layout, check_temperature
from .zorro.attention import FLEX_BLOCK, ZORRO_SUPPORTS, use_zorro_attention, zorro_mask

PACKED_SUPPORTS = ZORRO_SUPPORTS  # the packed naive layout runs the same attention hook

# auto: ZoRRo when the naive batch's matmul work per layer (tokens x parameters of one decoder
# layer) reaches this; below it a step is bound by the host's launches, not the GPU (H200,
# random Qwen3-0.6B, fwd + bwd with checkpointing, ``benchmarks/profile_zorro_step.py --scan``:
# ZoRRo 0.66-0.93x the packed naive step up to 12,288 naive tokens, 1.34x at 20,480): 16,384
# tokens x the 15.7M weights of one Qwen3-0.6B layer.
ZORRO_MIN_WORK = 16384 * 15_728_640


def layer_weights(config) -> int | None:
    """Weights of one decoder layer's matmuls from an HF config (dense models), or None when
    the config does not say (e.g. mixture-of-experts)."""
    cfg = getattr(config, "text_config", None) or config
    h, heads = getattr(cfg, "hidden_size", None), getattr(cfg, "num_attention_heads", None)
    inter = getattr(cfg, "intermediate_size", None)
    if not (isinstance(h, int) and isinstance(heads, int) and isinstance(inter, int)) or \
            any(getattr(cfg, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    d = getattr(cfg, "head_dim", None) or h // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return 2 * h * heads * d + 2 * h * kv * d + 3 * h * inter


def zorro_pays(model: torch.nn.Module, batch: RolloutBatch, zorro_attention: str) -> bool:
    """Whether ``zorro=True`` with ``zorro_attention="auto"`` runs the ZoRRo layout for this batch
    rather than the packed naive one (both exact; see ``ZORRO_MIN_WORK``). A forced attention
    (``"split"``, ``"flex"``, ``"varlen"``), the CPU, and models whose layer size is unknown
    always run ZoRRo."""
    if zorro_attention != "auto" or _device(model).type != "cuda":
        return True
    tokens = sum(p.size + r.size for p, r in zip(batch.prompts, batch.responses))
    return enough_work(tokens, layer_weights(model.config))


def enough_work(naive_tokens: int, weights: int | None) -> bool:
    """The rule of ``zorro_pays``: ``naive_tokens`` x ``weights`` (of one layer; None = unknown,
    take ZoRRo) reaches ``ZORRO_MIN_WORK``."""
    return weights is None or naive_tokens * weights >= ZORRO_MIN_WORK


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def check_inputs(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> None:
    """``ValueError`` unless ``batch`` and ``temperature`` suit ``model``: ids inside the vocabulary,
    every sample within the model's positions, temperature finite and >= ``MIN_TEMPERATURE``. Engines call it before
    touching any state (a refused micro-batch must not follow an accepted one)."""
    if not isinstance(batch, RolloutBatch):
        raise ValueError(f"compute_logprobs expects a polynya.RolloutBatch, got {type(batch).__name__}")
    check_temperature(temperature, "temperature")
    vocab = model.get_input_embeddings().num_embeddings
    for name, seqs in (("prompt_ids", batch.prompts), ("response_ids", batch.responses)):
        for i, s in enumerate(seqs):
            if s.size and int(s.max()) >= vocab:
                raise ValueError(f"{name}[{i}] has token id {int(s.max())} >= vocab size {vocab}")
    window = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(window, int):
        for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
            if p.size + r.size > window:
                raise ValueError(f"sample {i} has {p.size} prompt + {r.size} response tokens, more "
                                 f"than the model's {window} positions (max_position_embeddings): "
                                 "truncate it")


def check_model(model: torch.nn.Module, *, zorro: bool, train: bool = False,
                naive_layout: str = "auto") -> AttentionFeatures:
    """The model's attention features; ``ValueError`` (naming the model, the feature and the
    alternative) when ZoRRo (or, with ``zorro=False``, a forced ``naive_layout="packed"``) cannot
    honour one, or when training would drop a loss the model's config asks for. Engines call it
    at load time; ``compute_logprobs`` on every call."""
    check_naive_layout(naive_layout, "compute_logprobs")
    feats = attention_features(model)
    name = model_name(model)
    if zorro:
        feats.require("ZoRRo Train", name, supported=ZORRO_SUPPORTS,
                      alternative="call compute_logprobs(..., zorro=False) (TrainConfig / "
                                  "LogProbConfig zorro=False) for this model")
    elif naive_layout == "packed":
        feats.require("The packed naive layout", name, supported=PACKED_SUPPORTS,
                      alternative="use naive_layout='padded' (or 'auto') for this model")
    cfg = text_config(model.config) if hasattr(model, "config") else None
    dropout = float(getattr(cfg, "attention_dropout", 0.0) or 0.0)
    if (train or model.training) and dropout > 0:
        raise ValueError(f"{name} sets attention_dropout={dropout}, which polynya's attention paths "
                         "(ZoRRo, the packed naive layout, the fused GPU kernels) do not apply, so "
                         "log-probs would depend on the batch layout; set attention_dropout=0.0 in "
                         "the model config (RL post-training runs without it)")
    if train and feats.router_aux_loss:
        raise ValueError(f"{name} sets output_router_logits=True (the MoE router load-balancing "
                         f"loss, coefficient {feats.router_aux_loss_coef}), which polynya's "
                         "losses do not add; set output_router_logits=False to train without it")
    return feats


def naive_layout_for(feats: AttentionFeatures, naive_layout: str) -> str:
    """The layout ``zorro=False`` runs: ``"auto"`` is packed unless the model has an attention
    feature the packed layout does not implement (then padded: both are exact)."""
    if naive_layout != "auto":
        return naive_layout
    return "packed" if all(f in PACKED_SUPPORTS for f in feats.needs()) else "padded"


def _naive_inputs(batch: RolloutBatch, pad_id: int):
    """One right-padded row per sample; causal attention never lets real tokens see padding."""
    seqs = [torch.from_numpy(np.concatenate([p, r]))
            for p, r in zip(batch.prompts, batch.responses)]
    length = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), length), dtype=torch.long)
    pred, tgt, orow, ocol = [], [], [], []
    for i, (s, p, r) in enumerate(zip(seqs, batch.prompts, batch.responses)):
        ids[i, :s.numel()] = s
        attn[i, :s.numel()] = 1
        if r.size:
            pred.append(i * length + p.size - 1 + torch.arange(r.size))
            tgt.append(torch.from_numpy(r))
            orow.append(torch.full((r.size,), i))
            ocol.append(torch.arange(r.size))
    cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long))
    return ids, attn, cat(pred), cat(tgt), cat(orow), cat(ocol)


def compute_logprobs(model: torch.nn.Module, batch: RolloutBatch, *, zorro: bool = True,
                     entropy: bool = False, temperature: float = 1.0,
                     max_tokens_per_row: int | None = None, chunk_size: int | None = None,
                     zorro_attention: str = "auto", naive_layout: str = "auto") -> TokenStats:
    """Per-token log-probs (and entropy) of each sample's response under ``model``.

    Args:
        model: an HF causal LM (under DeepSpeed pass ``engine.module``).
        batch: the samples; rows come back in this order.
        zorro: compute shared prefixes once (exact); False computes every sample on its own.
            With ``zorro_attention="auto"`` on a GPU a batch too small to keep the GPU busy runs
            the packed naive layout instead (``zorro_pays``: there the step is bound by kernel
            launches and ZoRRo's extra attention calls cost more than the work it saves);
            ``TokenStats.layout`` says which layout ran.
        entropy: also return the entropy of each predictive distribution.
        temperature: logits are divided by it (per call).
        max_tokens_per_row: packing budget per row of the packed layouts (ZoRRo: deduplicated
            tokens; packed naive: prompt + response tokens); None: one row; groups never split.
        chunk_size: tokens per LM-head chunk (default: ~256 MiB of logits).
        zorro_attention: GPU attention of the packed layouts: ``"auto"`` (rows that share
            nothing: FlashAttention-2 varlen, or cuDNN over the padded samples when they
            are long and near-equal; shared prefixes: split cuDNN calls per prefix when the
            kernels can take the model and it pays, else FlexAttention), ``"split"``, ``"flex"``
            or ``"varlen"`` (``polynya.zorro.attention``); CPU runs a dense mask + SDPA (ZoRRo)
            or each segment on its own (packed naive).
        naive_layout: with ``zorro=False``: ``"packed"`` (samples back to back, no padding),
            ``"padded"`` (one right-padded row per sample) or ``"auto"`` (packed unless the
            model needs an attention feature only the padded layout runs, e.g. sinks).
    Returns:
        ``TokenStats`` with ``logprobs`` / ``entropy`` ``[B, Rmax]`` float32 and ``mask``
        ``[B, Rmax]``; differentiable w.r.t. the model's parameters.
    """
    check_inputs(model, batch, temperature)
    device = _device(model)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    base = model.base_model
    feats = check_model(model, zorro=zorro, naive_layout=naive_layout)
    if zorro and not zorro_pays(model, batch, zorro_attention):
        zorro, naive_layout = False, "packed"  # check_model(zorro=True) covered the packed layout
    layout = "zorro" if zorro else naive_layout_for(feats, naive_layout)
    if layout != "padded":
        use_zorro_attention(model)
        rows = pack_rows(batch, max_tokens_per_row=max_tokens_per_row, share=zorro,
                         pad_multiple=FLEX_BLOCK if device.type == "cuda" else 1, pad_id=pad_id).to(device)
        mask = zorro_mask(rows.tin, rows.tout, rows.nodes, zorro_attention, rows.position_ids, feats)
        hidden = base(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=mask,
                      use_cache=False).last_hidden_state
        pred, tgt, orow, ocol = rows.pred_index, rows.pred_target, rows.out_row, rows.out_col
    else:
        ids, attn, pred, tgt, orow, ocol = (t.to(device) for t in _naive_inputs(batch, pad_id))
        hidden = base(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, pred)
    lp, ent = token_stats(model.get_output_embeddings(), hidden, tgt,
                          temperature=feats.head_temperature(temperature), entropy=entropy,
                          softcap=feats.final_softcap, chunk_size=chunk_size)
    shape = (len(batch), batch.max_response_len)
    out_lp = lp.new_zeros(shape).index_put((orow, ocol), lp)
    out_ent = ent.new_zeros(shape).index_put((orow, ocol), ent) if entropy else None
    return TokenStats(out_lp, out_ent, batch.response_mask().to(device), layout=layout)

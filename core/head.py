"""Token log-probs and entropy through the LM head without ``[tokens, vocab]`` logits.

``token_stats(head, hidden, target)`` is the head half of ``polynya.compute_logprobs``. For a
plain ``nn.Linear`` head (the common case) it runs ``LinearTokenStats``: a custom autograd
function that walks the tokens in chunks, keeps only the per-token log-sum-exp for backward, and
in backward recomputes one chunk's logits and turns them into the logit gradient in place. The
per-chunk statistics are ``polynya.kernels.head``: on CUDA one Triton pass over the head GEMM's
bf16 logits each way (fp32 sums; one chunk buffer alive), plain torch elsewhere. Any other head — a ZeRO-3 partitioned weight, a
LoRA or quantised layer, a logit soft-cap — goes through the module itself, one checkpointed
chunk at a time (the same math through autograd, so ZeRO-3's hooks gather the weight).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .kernels.head import logit_grad, row_stats

LOGITS_CHUNK_BYTES = 1 << 28  # logits per chunk of the LM head (256 MiB)


def _chunks(n: int, size: int):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


class LinearTokenStats(torch.autograd.Function):
    """(hidden ``[N, H]``, weight ``[V, H]``, bias ``[V]`` | None, target ``[N]``) ->
    (log-prob ``[N]``, entropy ``[N]`` | None), fp32, logits ``= hidden @ weight.T / T``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, temperature, want_entropy, chunk):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n, dtype=torch.float32) if want_entropy else None
        for s, e in _chunks(n, chunk):
            lp, ls, en = row_stats(F.linear(hidden[s:e], weight, bias), target[s:e], temperature,
                                   want_entropy)
            logp[s:e], lse[s:e] = lp, ls
            if want_entropy:
                ent[s:e] = en
        ctx.save_for_backward(hidden, weight, bias, target, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, target, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = torch.zeros_like(weight) if need_w else None
        d_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        use_ent = g_ent is not None and ent is not None
        for s, e in _chunks(hidden.shape[0], ctx.chunk):
            h = hidden[s:e]
            dz = logit_grad(F.linear(h, weight, bias), target[s:e], lse[s:e],
                            ent[s:e] if use_ent else None, g_logp[s:e],
                            g_ent[s:e] if use_ent else None, ctx.temperature)
            if need_b:
                d_bias += dz.float().sum(0)
            dz = dz.to(hidden.dtype)
            if need_h:
                d_hidden[s:e] = dz @ weight
            if need_w:
                d_weight.addmm_(dz.t(), h)
        return (d_hidden, d_weight, None if d_bias is None else d_bias.to(weight.dtype),
                None, None, None, None)


def _module_chunk(head, hidden, target, temperature, softcap, want_entropy):
    logits = head(hidden).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, target[:, None]).squeeze(-1) - lse
    if not want_entropy:
        return logp, None
    return logp, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _plain_linear(head: torch.nn.Module) -> bool:
    w = getattr(head, "weight", None)
    return (type(head) is torch.nn.Linear and w is not None and w.dim() == 2 and w.numel() > 0
            and not hasattr(w, "ds_id"))


def token_stats(head: torch.nn.Module, hidden: torch.Tensor, target: torch.Tensor, *,
                temperature: float = 1.0, entropy: bool = False, softcap: float | None = None,
                chunk_size: int | None = None):
    """Log-prob of ``target`` and entropy under ``head(hidden) / temperature``, chunk by chunk.

    Args:
        head: the LM head module. hidden: ``[N, H]``. target: ``[N]`` token ids.
        softcap: the model's final logit soft-cap, if any (applied before the temperature).
        chunk_size: tokens per chunk (default: ~256 MiB of logits).
    Returns:
        ``([N] float32, [N] float32 | None)``, differentiable w.r.t. ``hidden`` and the head.
    """
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    elem = hidden.element_size() if hidden.is_cuda else 4  # CUDA keeps only the GEMM's logits
    chunk = chunk_size or max(16, LOGITS_CHUNK_BYTES // (elem * vocab))
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    if hidden.shape[0] == 0 and not grad:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if entropy else None)
    if _plain_linear(head) and not softcap:  # no rows: zero gradients, no kernel launched
        return LinearTokenStats.apply(hidden, head.weight, head.bias, target, float(temperature),
                                      entropy, chunk)
    if hidden.shape[0] == 0:  # still a graph: a micro-batch with no tokens has a (zero) backward
        return _module_chunk(head, hidden, target, temperature, softcap, entropy)
    lps, ents = [], []
    for s, e in _chunks(hidden.shape[0], chunk):
        args = (head, hidden[s:e], target[s:e], temperature, softcap, entropy)
        lp, ent = checkpoint(_module_chunk, *args, use_reentrant=False) if grad else _module_chunk(*args)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if entropy else None)

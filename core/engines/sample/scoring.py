"""Prompt log-probs: scoring given token sequences on a sampler's weights (vLLM's
``prompt_logprobs``; TRL's ``VLLMClient.get_sequence_logprobs`` asks for it).

    out = engine.prompt_logprobs([[5, 6, 7, 8]], top_k=5, temperature=0.7)
    out[0].logprobs   # [3]: log p(seq[i] | seq[:i]) for i = 1..3, float32
    out[0].ranks      # [3]: 1 + number of tokens more likely than seq[i]
    out[0].top_ids, out[0].top_logprobs   # [3, 5]: the 5 most likely tokens, most likely first

Log-probs are those of ``softcap(logits) / temperature`` (temperature 0 means 1, as the
sampler's greedy log-probs), in float32 from the model's logits: the same numbers
``polynya.compute_logprobs`` gives for the same tokens at that temperature. ``validate_scoring``
checks a request before anything runs; ``score_hidden`` is the head half, in chunks of positions
so that ``[tokens, vocab]`` logits never exist at once.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from polynya.types import TokenSeq, as_token_array

LOGITS_CHUNK_BYTES = 1 << 28  # fp32 logits per chunk of positions (256 MiB)


@dataclass
class PromptLogprobs:
    """Scores of one sequence of ``L`` tokens (positions 1..L-1; nothing predicts token 0).

    Args:
        logprobs: ``[L-1]`` float32, log-prob of each token given the tokens before it.
        ranks: ``[L-1]`` int64, 1 + how many tokens have a strictly higher log-prob.
        top_ids: ``[L-1, k]`` int64, the ``k`` most likely tokens, most likely first.
        top_logprobs: ``[L-1, k]`` float32, their log-probs.
    """

    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def validate_scoring(sequences: Sequence[TokenSeq], top_k: int, temperature: float, *,
                     vocab_size: int, max_model_len: int) -> tuple[list[list[int]], int, float]:
    """Check a scoring request; returns ``(sequences as lists, k, temperature)`` with ``k``
    resolved (-1: the whole vocabulary) and temperature 0 read as 1. ``ValueError`` names the
    first problem."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"prompt_logprobs must be an int >= -1 (-1: the whole vocabulary), got {top_k!r}")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence) or not sequences:
        raise ValueError("sequences must be a non-empty list of token-id lists")
    out = []
    for i, seq in enumerate(sequences):
        arr = as_token_array(seq, f"sequences[{i}]")
        if arr.size == 0:
            raise ValueError(f"sequences[{i}] is empty")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"sequences[{i}] has a token id outside [0, {vocab_size})")
        if arr.size > max_model_len:
            raise ValueError(f"sequences[{i}] has {arr.size} tokens; the model window here is {max_model_len}")
        out.append(arr.tolist())
    k = vocab_size if top_k == -1 else min(top_k, vocab_size)
    return out, k, float(temperature) or 1.0


def score_hidden(head: torch.nn.Module, hidden: torch.Tensor, target: torch.Tensor, *, top_k: int,
                 temperature: float, softcap: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob and rank of ``target`` and the ``top_k`` best tokens under
    ``softcap(head(hidden)) / temperature``.

    Args:
        head: the LM head. hidden: ``[N, H]`` states predicting ``target`` ``[N]``.
    Returns:
        ``(logprobs [N] f32, ranks [N] i64, top_ids [N, k] i64, top_logprobs [N, k] f32)``.
    """
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    chunk = max(16, LOGITS_CHUNK_BYTES // (4 * vocab))
    if hidden.shape[0] == 0:
        f32 = {"dtype": torch.float32}
        return (hidden.new_zeros(0, **f32), target.new_zeros(0), target.new_zeros(0, top_k),
                hidden.new_zeros(0, top_k, **f32))
    lps, ranks, ids, tops = [], [], [], []
    for s in range(0, hidden.shape[0], chunk):
        logits = head(hidden[s:s + chunk]).float()
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        lp = logp.gather(-1, target[s:s + chunk, None])
        lps.append(lp[:, 0])
        ranks.append((logp > lp).sum(-1) + 1)
        v, i = logp.topk(top_k, dim=-1) if top_k else (logp[:, :0], target[s:s + chunk, None][:, :0])
        tops.append(v)
        ids.append(i)
    return torch.cat(lps), torch.cat(ranks), torch.cat(ids), torch.cat(tops)

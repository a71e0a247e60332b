"""TRL <-> polynya data translation (plain torch; no TRL import).

TRL's GRPO trainer carries a batch as padded tensors: ``input_ids = [left-padded prompt |
right-padded completion]`` with an ``attention_mask`` of the same shape and ``logits_to_keep`` =
the completion width. polynya takes token lists (``RolloutBatch``). These functions convert one
to the other and back, and lay out prompt groups so that micro-batches hold whole groups.

    batch = rollout_batch(input_ids, attention_mask, logits_to_keep)   # -> RolloutBatch
    prompts, counts = unique_prompts(prompt_ids)                       # one request per prompt
    perm = group_permutation(num_rows, group_size)                     # shuffle groups, not rows
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...types import RolloutBatch


def _runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: number of ones and whether they form one contiguous run."""
    n = mask.sum(dim=1)
    edges = (mask[:, 1:] != mask[:, :-1]).sum(dim=1)
    return n, edges


def rollout_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  logits_to_keep: int) -> RolloutBatch:
    """TRL's ``(input_ids, attention_mask, logits_to_keep)`` as a ``RolloutBatch``.

    Args:
        input_ids / attention_mask: ``[B, P + C]``; the prompt part ``[:, :P]`` is left-padded, the
            completion part ``[:, P:]`` (``C = logits_to_keep``) right-padded.
    Returns:
        a batch whose sample ``i`` is (the unpadded prompt, the unmasked completion prefix). A
        completion masked out entirely (TRL's ``mask_truncated_completions``) becomes empty.
    Raises:
        ValueError: a mask that is not of that shape (holes, a left-padded completion, an empty
        prompt), which this translation would misread.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must be the same [B, L] shape")
    width = input_ids.shape[1] - logits_to_keep
    if not 0 < logits_to_keep <= input_ids.shape[1] - 1:
        raise ValueError(f"logits_to_keep={logits_to_keep} leaves no prompt in a width of {input_ids.shape[1]}")
    mask = attention_mask.bool().cpu()
    ids = input_ids.cpu()
    p_mask, c_mask = mask[:, :width], mask[:, width:]
    p_len, p_edges = _runs(p_mask)
    c_len, c_edges = _runs(c_mask)
    bad_p = (p_len == 0) | (p_edges > 1) | ((p_edges == 1) & p_mask[:, 0])
    bad_c = (c_edges > 1) | ((c_edges == 1) & ~c_mask[:, 0])
    if bad_p.any() or bad_c.any():
        row = int((bad_p | bad_c).nonzero()[0])
        raise ValueError(f"row {row}: the adapter reads a left-padded prompt followed by a "
                         "right-padded completion; this attention mask has holes or the wrong "
                         "padding side")
    prompts = [ids[i, width - int(p_len[i]):width] for i in range(ids.shape[0])]
    responses = [ids[i, width:width + int(c_len[i])] for i in range(ids.shape[0])]
    return RolloutBatch(prompts, responses)


def to_trl_layout(values: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """``[B, Rmax]`` per-token values (zeros past each response) -> TRL's ``[B, logits_to_keep]``."""
    b, r = values.shape
    if r == logits_to_keep:
        return values
    if r > logits_to_keep:
        raise ValueError(f"{r} response positions do not fit logits_to_keep={logits_to_keep}")
    return torch.cat([values, values.new_zeros(b, logits_to_keep - r)], dim=1)


def group_chunks(batch: RolloutBatch, rows_per_chunk: int) -> list[range]:
    """Consecutive row ranges of about ``rows_per_chunk`` rows that never cut a run of rows with
    the same prompt (TRL's ``batch_size`` memory chunking, kept group-whole for ZoRRo)."""
    n, out, start = len(batch), [], 0
    while start < n:
        end = min(start + max(rows_per_chunk, 1), n)
        while end < n and _same(batch.prompts[end], batch.prompts[end - 1]):
            end += 1
        out.append(range(start, end))
        start = end
    return out


def _same(a, b) -> bool:
    return a.size == b.size and bool((a == b).all())


def unique_prompts(prompt_ids: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """Runs of identical consecutive prompts -> (one prompt per run, run lengths).

    TRL repeats each prompt ``num_generations`` times in a row; each run becomes one sampler
    request with ``n`` = its length, so the prompt is prefilled once.
    """
    prompts, counts = [], []
    for p in prompt_ids:
        p = list(p)
        if prompts and prompts[-1] == p:
            counts[-1] += 1
        else:
            prompts.append(p)
            counts.append(1)
    return prompts, counts


def group_permutation(num_rows: int, group_size: int, generator: torch.Generator | None = None
                      ) -> torch.Tensor:
    """A random row order that moves whole groups of ``group_size`` consecutive rows."""
    if group_size < 1 or num_rows % group_size:
        raise ValueError(f"{num_rows} rows do not split into groups of {group_size}")
    groups = torch.randperm(num_rows // group_size, generator=generator)
    return (groups[:, None] * group_size + torch.arange(group_size)[None, :]).flatten()


def check_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int) -> None:
    """``ValueError`` unless each block of ``group_size`` consecutive rows holds one prompt
    (the layout TRL's ``RepeatSampler`` produces and the group-whole split relies on)."""
    n = prompt_ids.shape[0]
    if n % group_size:
        raise ValueError(f"{n} rows are not whole groups of num_generations={group_size}")
    ids = prompt_ids.masked_fill(~prompt_mask.bool(), -1).view(n // group_size, group_size, -1)
    if not (ids == ids[:, :1]).all():
        raise ValueError("the generation batch is not laid out as num_generations consecutive rows "
                         "per prompt; polynya's TRL adapter keeps groups whole and needs that layout")


def permute_rows(batch: dict, perm: torch.Tensor) -> dict:
    """Apply one row order to every per-row entry of TRL's batch dict (tensors and lists); 0-d
    tensors and None stay as they are (as TRL's ``shuffle_sequence_dict`` does)."""
    def one(v):
        if v is None or (isinstance(v, torch.Tensor) and v.dim() == 0):
            return v
        if isinstance(v, torch.Tensor):
            return v[perm.to(v.device)]
        return [v[i] for i in perm.tolist()]

    return {k: one(v) for k, v in batch.items()}

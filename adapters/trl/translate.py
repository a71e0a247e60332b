"""TRL <-> polynya data translation (plain torch; no TRL import).

TRL's GRPO trainer carries a batch as padded tensors: ``input_ids = [left-padded prompt |
right-padded completion]`` with an ``attention_mask`` of the same shape and ``logits_to_keep`` =
the completion width. polynya takes token lists (``RolloutBatch``). These functions convert one
to the other and back, and lay out prompt groups so that micro-batches hold whole groups.

    batch = rollout_batch(input_ids, attention_mask, logits_to_keep)   # -> RolloutBatch
    prompts, counts = unique_prompts(prompt_ids)                       # one request per prompt
    perm = group_permutation(num_rows, group_size)                     # shuffle groups, not rows
    params = sampling_params(generation_config, max_tokens, stop_ids)  # transformers' sampling
    config_differences(policy.config.to_dict(), sampler_config.to_dict())  # -> ["key: a != b"]
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...types import RolloutBatch, SamplingParams

# ``GenerationConfig`` fields with which transformers' ``generate`` samples something polynya's
# sampler has no counterpart for, each with the values that leave it off (an empty list or
# dict is off too)
_NO_COUNTERPART = {
    "do_sample": (True,), "num_beams": (None, 1), "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "sequence_bias": (None,),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "exponential_decay_length_penalty": (None,),
    "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "top_h": (None,),
    "guidance_scale": (None, 1.0), "watermarking_config": (None,), "stop_strings": (None,),
    "max_time": (None,),
}


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


# model-config keys that do not change what a model computes: bookkeeping, initialisation,
# outputs, special-token ids, the attention backend, and the dtype (the weight push casts)
_BOOKKEEPING = frozenset({
    "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "architectures",
    "dtype", "torch_dtype", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "torchscript", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id",
    "decoder_start_token_id", "id2label", "label2id", "problem_type", "finetuning_task",
    "task_specific_params", "tokenizer_class", "prefix", "initializer_range",
    "chunk_size_feed_forward", "attn_implementation", "_attn_implementation_autoset",
})


def config_differences(policy: dict, sampler: dict) -> list[str]:
    """``"key: policy value != sampler value"`` for every model-config key (``config.to_dict()``)
    that may change what the model computes and differs between the two configs."""
    keys = sorted((set(policy) | set(sampler)) - _BOOKKEEPING)
    return [f"{k}: {policy.get(k)!r} != {sampler.get(k)!r}" for k in keys
            if policy.get(k) != sampler.get(k)]


def sampling_params(config, max_tokens: int, stop_token_ids: Sequence[int]) -> SamplingParams:
    """What transformers' ``generate`` samples with ``config`` as polynya ``SamplingParams``
    (``n=1``).

    Args:
        config: a ``GenerationConfig`` as ``generate`` completes it (TRL's, its unset fields
            taken from the model's ``generation_config``, then from transformers' defaults).
        max_tokens / stop_token_ids: TRL's ``max_completion_length`` and EOS ids.
    Raises:
        ValueError: naming every setting the sampler would not reproduce: a field that is on in
        ``_NO_COUNTERPART``, or ``min_p`` with ``top_p < 1`` (transformers filters top-p first
        and min-p on what is left, polynya's sampler min-p first, as vLLM: the kept tokens differ).
    """
    problems = [f"{k}={getattr(config, k)!r}" for k, off in _NO_COUNTERPART.items()
                if not _off(getattr(config, k, None), off)]
    top_p = 1.0 if config.top_p is None else float(config.top_p)
    min_p = 0.0 if config.min_p is None else float(config.min_p)
    if min_p > 0 and top_p < 1:
        problems.append(f"min_p={min_p} together with top_p={top_p} (transformers applies min-p "
                        "after top-p, polynya's sampler before it; keep one of the two)")
    if problems:
        raise ValueError("polynya's sampler cannot sample as TRL's transformers generation would "
                         "with: " + "; ".join(problems) + " (set in GRPOConfig, or inherited from "
                         "the model's generation_config: unset them there, or use trl.GRPOTrainer)")
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    return SamplingParams(n=1, temperature=temperature, top_p=top_p, min_p=min_p,
                          top_k=-1 if not config.top_k else int(config.top_k),  # 0 / None: off
                          max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), logprobs=False)


def _off(value, off: tuple) -> bool:
    return value in off or (isinstance(value, (list, tuple, dict)) and not value)


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

"""TRL <-> polynya data translation (plain torch; no TRL import).

TRL's GRPO trainer carries a batch as padded tensors: ``input_ids = [left-padded prompt |
right-padded completion]`` with an ``attention_mask`` of the same shape and ``logits_to_keep`` =
the completion width. polynya takes token lists (``RolloutBatch``). These functions convert one
to the other and back, lay out prompt groups so that micro-batches hold whole groups, and turn
TRL's generation settings into the sampler's ``SamplingParams`` (or say why they cannot be).

    batch = rollout_batch(input_ids, attention_mask, logits_to_keep)   # -> RolloutBatch
    prompts, counts = unique_prompts(prompt_ids)                       # one request per prompt
    perm = group_permutation(num_rows, group_size)                     # shuffle groups, not rows
    problems = generation_kwargs_problems(args.generation_kwargs)      # ["key=value (why)"]
    params = sampling_params(generation_config, stop_ids)              # transformers' sampling
    config_differences(policy.config.to_dict(), sampler_config.to_dict())  # -> ["key: a != b"]
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...types import RolloutBatch, SamplingParams


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


# ``GenerationConfig`` fields with which transformers' ``generate`` samples otherwise than
# polynya's sampler can: each with the values that leave it off (an empty list or dict is off
# too) and why it is refused when on
_PROCESSOR = "a logits processor the native sampler has no counterpart for"
_FILTER = "a sampling filter the native sampler has no counterpart for"
_STOP = "a stopping criterion the native sampler has no counterpart for"
_MODE = "another decoding mode than sampling / greedy"
_NO_COUNTERPART = {
    "num_beams": ((None, 1), "beam search"), "num_beam_groups": ((None, 1), "beam search"),
    "constraints": ((None,), _MODE), "force_words_ids": ((None,), _MODE),
    "penalty_alpha": ((None, 0.0), _MODE), "dola_layers": ((None,), _MODE),
    "prompt_lookup_num_tokens": ((None,), _MODE), "assistant_early_exit": ((None,), _MODE),
    "use_mtp": ((None, False), _MODE),
    "num_return_sequences": ((None, 1), "more completions per prompt than TRL's rows"),
    "repetition_penalty": ((None, 1.0), _PROCESSOR),
    "encoder_repetition_penalty": ((None, 1.0), _PROCESSOR + (" (on a decoder-only model it "
                                                              "penalises the prompt's tokens)")),
    "no_repeat_ngram_size": ((None, 0), _PROCESSOR),
    "encoder_no_repeat_ngram_size": ((None, 0), _PROCESSOR),
    "bad_words_ids": ((None,), _PROCESSOR), "sequence_bias": ((None,), _PROCESSOR),
    "forced_bos_token_id": ((None,), _PROCESSOR), "forced_eos_token_id": ((None,), _PROCESSOR),
    "exponential_decay_length_penalty": ((None,), _PROCESSOR),
    "suppress_tokens": ((None,), _PROCESSOR), "begin_suppress_tokens": ((None,), _PROCESSOR),
    "remove_invalid_values": ((None, False), _PROCESSOR),
    "guidance_scale": ((None, 1.0), _PROCESSOR), "watermarking_config": ((None,), _PROCESSOR),
    "min_length": ((None, 0), ("transformers counts it from the left-padded prompt, so what it "
                               "bans depends on the batch (min_new_tokens is translated)")),
    "typical_p": ((None, 1.0), _FILTER), "epsilon_cutoff": ((None, 0.0), _FILTER),
    "eta_cutoff": ((None, 0.0), _FILTER), "top_h": ((None,), _FILTER),
    "stop_strings": ((None,), _STOP), "max_time": ((None,), _STOP),
    "return_dict_in_generate": ((None, False), ("TRL's own generation reads generate's output "
                                                "as a tensor and would fail")),
}
# ``GRPOConfig.generation_kwargs`` keys besides those above. TRL's own generation merges
# generation_kwargs over its settings into one ``GenerationConfig`` (``generation_kwargs`` win);
# ``sampling_params`` reads that config, so these reach the sampler with TRL's precedence
_TRANSLATED = frozenset({"do_sample", "temperature", "top_p", "top_k", "min_p", "max_new_tokens",
                         "min_new_tokens", "eos_token_id"})
# keys that leave the sampled tokens as they are: generate's KV caching, what it returns besides
# the tokens, ids for padding (prompts come with their attention mask, completions are cut at
# the first EOS), and a log-softmax of the processed logits (sampling and argmax are unchanged)
_INERT = frozenset({"use_cache", "output_scores", "output_logits", "pad_token_id", "bos_token_id",
                    "renormalize_logits"})
_REFUSED = {"max_length": ("a total length counting the left-padded prompt, ignored next to "
                           "TRL's max_new_tokens; set max_completion_length")}


def generation_kwargs_problems(kwargs: dict | None) -> list[str]:
    """``"key=value (why)"`` for every ``GRPOConfig.generation_kwargs`` key the sampler would not
    honour as TRL's own (non-vLLM) generation does: one on in ``_NO_COUNTERPART``, one in
    ``_REFUSED``, and any key not known here (transformers keeps an unknown key on the config and
    ignores it; the user meant something by it). The values of the translated keys are checked
    by ``sampling_params`` on the config in effect."""
    problems = []
    for key, value in (kwargs or {}).items():
        if key in _TRANSLATED or key in _INERT:
            continue
        if key in _NO_COUNTERPART:
            off, why = _NO_COUNTERPART[key]
            if not _off(value, off):
                problems.append(f"{key}={value!r} ({why})")
        else:
            why = _REFUSED.get(key, "not a generation setting the adapter translates")
            problems.append(f"{key}={value!r} ({why})")
    return problems


def sampling_params(config, stop_token_ids: Sequence[int]) -> SamplingParams:
    """What transformers' ``generate`` samples with ``config`` as polynya ``SamplingParams``
    (``n=1``): ``do_sample`` not ``True`` is greedy (``temperature=0``: the first argmax, as
    transformers' greedy search); ``max_new_tokens`` / ``min_new_tokens`` are ``max_tokens`` /
    ``min_tokens`` (transformers bans the EOS ids until then, the sampler its stop ids: the same
    ids, checked).

    Args:
        config: a ``GenerationConfig`` as ``generate`` completes it (TRL's with its
            ``generation_kwargs`` merged in, its unset fields taken from the model's
            ``generation_config``, then from transformers' defaults).
        stop_token_ids: the EOS ids TRL cuts completions at.
    Raises:
        ValueError: naming every setting the sampler would not reproduce (``_problems``).
    """
    problems = _problems(config, stop_token_ids)
    if problems:
        raise ValueError("polynya's sampler cannot sample as TRL's transformers generation would "
                         "with: " + "; ".join(problems) + " (set in GRPOConfig or its "
                         "generation_kwargs, or inherited from the model's generation_config: unset "
                         "them there, or use trl.GRPOTrainer)")
    max_tokens = config.max_new_tokens
    # a min_new_tokens past max_new_tokens bans EOS throughout, as min_tokens = max_tokens does
    min_tokens = min(config.min_new_tokens or 0, max_tokens)
    common = {"n": 1, "max_tokens": max_tokens, "min_tokens": min_tokens,
              "stop_token_ids": list(stop_token_ids), "logprobs": False}
    if config.do_sample is not True:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=_or(config.temperature, 1.0), top_p=_or(config.top_p, 1.0),
                          min_p=_or(config.min_p, 0.0),
                          top_k=-1 if not config.top_k else int(config.top_k), **common)  # 0 / None: off


def _problems(config, stop_token_ids: Sequence[int]) -> list[str]:
    """``"field=value (why)"`` for each setting of a completed ``GenerationConfig`` the sampler
    would not reproduce: a field on in ``_NO_COUNTERPART``; EOS ids other than TRL's (transformers
    would stop at them and TRL cut at its own, keeping the batch's padding: batch-dependent);
    ``max_new_tokens`` / ``min_new_tokens`` that are no counts; when sampling, what transformers
    itself refuses (``temperature <= 0``, a negative ``top_k``) and ``min_p`` with ``top_p < 1``
    (transformers filters top-p first and min-p on what is left, polynya's sampler min-p first,
    as vLLM: the kept tokens differ)."""
    problems = [f"{k}={getattr(config, k)!r} ({why})" for k, (off, why) in _NO_COUNTERPART.items()
                if not _off(getattr(config, k, None), off)]
    eos = config.eos_token_id
    if set([eos] if isinstance(eos, int) else eos or ()) != set(stop_token_ids):
        problems.append(f"eos_token_id={eos!r} (TRL cuts completions at {list(stop_token_ids)}; "
                        "transformers would stop elsewhere and pad the batch's finished rows)")
    if not _count(config.max_new_tokens, 1):
        problems.append(f"max_new_tokens={config.max_new_tokens!r} (an int >= 1: without one, "
                        "transformers counts max_length from the left-padded batch)")
    if config.min_new_tokens is not None and not _count(config.min_new_tokens, 0):
        problems.append(f"min_new_tokens={config.min_new_tokens!r} (an int >= 0)")
    if config.do_sample is not True:
        return problems  # greedy: transformers applies no temperature and no filters
    temperature, top_k = _or(config.temperature, 1.0), _or(config.top_k, 0)
    top_p, min_p = _or(config.top_p, 1.0), _or(config.min_p, 0.0)
    if temperature <= 0:
        problems.append(f"temperature={temperature} with do_sample=True (transformers refuses it; "
                        "greedy decoding is do_sample=False)")
    if top_k < 0:
        problems.append(f"top_k={top_k} (transformers refuses a negative top_k; 0 is off)")
    if min_p > 0 and top_p < 1:
        problems.append(f"min_p={min_p} together with top_p={top_p} (transformers applies min-p "
                        "after top-p, polynya's sampler before it; keep one of the two)")
    return problems


def _or(value, default):
    return default if value is None else value


def _count(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


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

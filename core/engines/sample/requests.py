"""Request validation shared by every sampling backend, and the sample of a request stopped
before it sampled anything.

A bad request raises ``ValueError`` naming its index *before* anything is queued, so the other
requests of the call — and those of concurrent calls — are untouched.

``SamplingParams`` is a mutable dataclass, and callers reuse one object across calls: the
requests run on a private copy taken here (checked again as it is copied), so what was checked is
what runs, and changing the caller's object later changes nothing already queued.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from polynya.types import Sample, SamplingParams, TokenSeq, as_token_array, params_per_prompt


def validate_requests(prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams],
                      *, vocab_size: int, max_model_len: int, max_n: int | None = None
                      ) -> tuple[list[list[int]], list[SamplingParams]]:
    """Check every request.

    Args:
        prompts: token-id sequences, one per request. params: one for all, or one per prompt.
        vocab_size: ids must be below it. max_model_len: a prompt must be shorter (room for
            one new token). max_n: largest ``n`` the backend can run at once (None: no limit).
    Returns:
        ``(prompts as lists of ints, one SamplingParams per prompt)``: the params are private
        copies (one per distinct object passed), the values as of this call.
    """
    plist = private_copies(params_per_prompt(prompts, params))
    toks = []
    for i, (prompt, p) in enumerate(zip(prompts, plist)):
        arr = as_token_array(prompt, f"prompts[{i}]")
        if arr.size == 0:
            raise ValueError(f"prompts[{i}] is empty")
        if arr.max() >= vocab_size:
            raise ValueError(f"prompts[{i}] has token id {int(arr.max())} >= vocab size {vocab_size}")
        if arr.size >= max_model_len:
            raise ValueError(f"prompts[{i}] has {arr.size} tokens; the model window here is "
                             f"{max_model_len} (prompt + at least one new token)")
        if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
            raise ValueError(f"params[{i}].max_tokens must be >= 1, got {p.max_tokens!r}")
        if not isinstance(p.n, int) or p.n < 1 or (max_n is not None and p.n > max_n):
            raise ValueError(f"params[{i}].n must be in [1, {max_n}], got {p.n!r}")
        toks.append(arr.tolist())
    return toks, plist


def private_copies(params):
    """``params`` (one ``SamplingParams`` or a list) copied now, one copy per distinct object
    (``__post_init__`` checks the fields as they are now: ``ValueError`` naming the index);
    entries that are not ``SamplingParams`` pass through, for the caller's own check."""
    if isinstance(params, SamplingParams):
        return private_copies([params])[0]
    if not isinstance(params, Sequence):
        return params
    copies: dict[int, SamplingParams] = {}
    for i, p in enumerate(params):
        if isinstance(p, SamplingParams) and id(p) not in copies:
            try:
                copies[id(p)] = dataclasses.replace(p)
            except ValueError as exc:
                raise ValueError(f"params[{i}]: {exc}") from None
    return [copies.get(id(p), p) for p in params]


def unstarted_sample(params: SamplingParams) -> Sample:
    """A sample aborted before its first token: empty, ``finish_reason="abort"``."""
    return Sample(token_ids=[], logprobs=[] if params.logprobs else None, finish_reason="abort")

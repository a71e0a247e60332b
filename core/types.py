"""Plain data exchanged between polynya's rooms: rollout batches, token statistics, sampling.

Every engine takes and returns these small dataclasses (never framework objects). They are
validated on construction so that a bad batch fails at the API boundary with a message that
names the problem, before any engine state is touched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np
import torch

TokenSeq = Union[Sequence[int], torch.Tensor, np.ndarray]


def as_token_array(seq: TokenSeq, what: str) -> np.ndarray:
    """Return ``seq`` as a 1-D int64 numpy array, or raise ``ValueError`` naming ``what``."""
    if isinstance(seq, torch.Tensor):
        if seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
            raise ValueError(f"{what}: token ids must be integers, got a {seq.dtype} tensor")
        arr = seq.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(seq)
        except Exception as exc:  # ragged nested lists and the like
            raise ValueError(f"{what}: cannot read token ids ({exc})") from None
        if arr.size == 0:
            arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a flat sequence of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{what}: token ids must be >= 0, found {int(arr.min())}")
    return arr


def _as_float_tensor(x, what: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{what}: expected a float tensor, got {t.dtype}")
    return t.float()


@dataclass
class RolloutBatch:
    """A batch of (prompt, response) samples at token level.

    Args:
        prompt_ids: one entry per sample: list of ints or 1-D integer tensor, non-empty.
        response_ids: one entry per sample (may be empty); the tokens whose log-probs are wanted.
        group_ids: optional ``[B]`` ints; samples with the same id are kept in one packing unit
            (row, micro-batch, DP shard). Sharing itself is detected from token content.
        advantages: optional ``[B]`` (per sample) or ``[B, Rmax]`` (per token), finite.
        old_logprobs, ref_logprobs: optional ``[B, Rmax]`` float tensors.

    ``Rmax`` is the longest response. Rows keep the caller's order everywhere.
    """

    prompt_ids: Sequence[TokenSeq]
    response_ids: Sequence[TokenSeq]
    group_ids: Sequence[int] | None = None
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    prompts: list[np.ndarray] = field(init=False, repr=False)
    responses: list[np.ndarray] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.prompt_ids, (str, bytes)) or isinstance(self.response_ids, (str, bytes)):
            raise ValueError("prompt_ids / response_ids must be token ids, not text")
        n = len(self.prompt_ids)
        if n == 0:
            raise ValueError("RolloutBatch is empty: need at least one sample")
        if len(self.response_ids) != n:
            raise ValueError(
                f"prompt_ids has {n} samples but response_ids has {len(self.response_ids)}"
            )
        self.prompts = [as_token_array(p, f"prompt_ids[{i}]") for i, p in enumerate(self.prompt_ids)]
        self.responses = [
            as_token_array(r, f"response_ids[{i}]") for i, r in enumerate(self.response_ids)
        ]
        for i, p in enumerate(self.prompts):
            if p.size == 0:
                raise ValueError(f"prompt_ids[{i}] is empty: every sample needs a prompt")
        if self.group_ids is not None:
            g = as_token_array(self.group_ids, "group_ids")
            if g.size != n:
                raise ValueError(f"group_ids has {g.size} entries for {n} samples")
            self.group_ids = g.tolist()
        rmax = self.max_response_len
        if self.advantages is not None:
            a = _as_float_tensor(self.advantages, "advantages")
            if a.shape not in ((n,), (n, rmax)):
                raise ValueError(f"advantages must be [B]={n} or [B, Rmax]=[{n}, {rmax}], got {tuple(a.shape)}")
            if not torch.isfinite(a).all():
                raise ValueError("advantages contain NaN or inf")
            self.advantages = a
        for name in ("old_logprobs", "ref_logprobs"):
            v = getattr(self, name)
            if v is None:
                continue
            t = _as_float_tensor(v, name)
            if tuple(t.shape) != (n, rmax):
                raise ValueError(f"{name} must be [B, Rmax]=[{n}, {rmax}], got {tuple(t.shape)}")
            setattr(self, name, t)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def max_response_len(self) -> int:
        return max((r.size for r in self.responses), default=0)

    def response_mask(self) -> torch.Tensor:
        """``[B, Rmax]`` bool: True where a response token exists."""
        lens = torch.tensor([r.size for r in self.responses])
        return torch.arange(self.max_response_len)[None, :] < lens[:, None]

    def num_tokens(self) -> int:
        """Tokens of the naive layout (every sample's prompt + response)."""
        return sum(p.size + r.size for p, r in zip(self.prompts, self.responses))

    def select(self, rows: Sequence[int]) -> "RolloutBatch":
        """A new batch with the given rows (in that order); per-token fields are re-trimmed."""
        rows = list(rows)
        sub_r = [self.responses[i] for i in rows]
        rmax = max((r.size for r in sub_r), default=0)

        def pick(t):
            if t is None:
                return None
            t = t[rows]
            return t[:, :rmax] if t.dim() == 2 else t

        return RolloutBatch(
            prompt_ids=[self.prompts[i] for i in rows],
            response_ids=sub_r,
            group_ids=None if self.group_ids is None else [self.group_ids[i] for i in rows],
            advantages=pick(self.advantages),
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
        )


@dataclass
class TokenStats:
    """Per-response-token statistics, rows in the batch's original order.

    logprobs: ``[B, Rmax]`` float32 (0 where ``mask`` is False);
    entropy: ``[B, Rmax]`` float32 or None; mask: ``[B, Rmax]`` bool;
    layout: how ``compute_logprobs`` ran the batch (``"zorro"``, ``"packed"``, ``"padded"``),
    None where the statistics came from elsewhere.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    mask: torch.Tensor
    layout: str | None = None


MIN_TEMPERATURE = 1e-5  # the smallest positive sampling temperature (vLLM's greedy threshold)


@dataclass
class SamplingParams:
    """How to sample a completion (vLLM-compatible names).

    ``temperature=0`` means greedy. ``top_k=-1`` and ``top_p=1`` disable those filters;
    ``min_p=0`` disables min-p. ``temperature`` is 0 or at least ``MIN_TEMPERATURE`` (below
    it ``logits / temperature`` overflows float32). The filters apply as in vLLM V1:
    temperature, then min-p, then top-k (tokens tied with the k-th logit kept), then top-p;
    greedy rows ignore them. ``top_k`` larger than the vocabulary is off.

    ``logprobs=True`` returns each sampled token's log-prob under the distribution it was
    sampled from (after temperature and filters; greedy: the model distribution at temperature
    1; both after a ``min_tokens`` ban) — vLLM's
    ``logprobs_mode="processed_logprobs"``, not vLLM's default ``"raw_logprobs"`` (log-softmax
    of the unscaled logits). The stop token, when one ends the completion, is in ``token_ids``
    with its log-prob and counts towards ``max_tokens``.

    ``min_tokens`` (vLLM's): the first ``min_tokens`` tokens of a completion are never stop
    tokens — the row's stop ids (EOS and ``stop_token_ids`` as the rule below says) are removed
    from its logits before temperature and filters, so the returned (processed) log-probs of
    those tokens are of the distribution without them. At most ``max_tokens``.

    Stopping: ``stop_at_eos=None`` (the default) stops at the model's EOS ids when
    ``stop_token_ids`` is None and at exactly ``stop_token_ids`` when a list is given (``[]``:
    never before ``max_tokens``). ``stop_at_eos=True`` stops at the EOS ids *and* at
    ``stop_token_ids`` (vLLM's rule, what vLLM-style requests mean); ``False`` only at
    ``stop_token_ids`` (vLLM's ``ignore_eos``). ``stops_at_eos`` is the rule in effect.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 256
    stop_token_ids: Sequence[int] | None = None
    seed: int | None = None
    logprobs: bool = False
    stop_at_eos: bool | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # numpy / 0-d tensor ints are accepted and stored as Python ints (the engines' checks,
        # seeds and codecs expect those)
        n, top_k, max_tokens, min_tokens = (_int(getattr(self, k), f"SamplingParams.{k}")
                                            for k in ("n", "top_k", "max_tokens", "min_tokens"))
        self.n, self.top_k, self.max_tokens, self.min_tokens = n, top_k, max_tokens, min_tokens
        if n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {n!r}")
        temperature = _real(self.temperature, "SamplingParams.temperature")
        if temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature!r}")
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r} is below {MIN_TEMPERATURE} "
                             "(logits / temperature would overflow): pass 0 for greedy decoding, "
                             "as vLLM treats temperatures this small")
        if not 0.0 < _real(self.top_p, "SamplingParams.top_p") <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if top_k < 1 and top_k != -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {top_k!r}")
        if not 0.0 <= _real(self.min_p, "SamplingParams.min_p") < 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1), got {self.min_p!r}")
        if max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {max_tokens!r}")
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be in [0, max_tokens={max_tokens}], "
                             f"got {min_tokens!r}")
        for k, v in (("n", n), ("top_k", top_k), ("max_tokens", max_tokens)):
            if v > INT32_MAX:  # the engines count tokens and samples in 32/64-bit integers
                raise ValueError(f"SamplingParams.{k} must be at most {INT32_MAX}, got {v!r}")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray, torch.Tensor)):
                raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids, got {ids!r}")
            self.stop_token_ids = tuple(_int(t, "SamplingParams.stop_token_ids[]") for t in ids)
            if any(t < 0 or t > INT64_MAX for t in self.stop_token_ids):
                raise ValueError(f"SamplingParams.stop_token_ids must be in [0, {INT64_MAX}]")
        if self.seed is not None:
            self.seed = _int(self.seed, "SamplingParams.seed")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"SamplingParams.logprobs must be a bool, got {self.logprobs!r}")
        if self.stop_at_eos is not None and not isinstance(self.stop_at_eos, bool):
            raise ValueError(f"SamplingParams.stop_at_eos must be None, True or False, got {self.stop_at_eos!r}")

    @property
    def stops_at_eos(self) -> bool:
        """Whether generation stops at the model's EOS ids (besides ``stop_token_ids``)."""
        return self.stop_token_ids is None if self.stop_at_eos is None else self.stop_at_eos

    def stop_ids(self, eos_ids) -> frozenset[int]:
        """The token ids that end a completion, given the model's EOS ids."""
        return frozenset(self.stop_token_ids or ()) | (frozenset(eos_ids) if self.stops_at_eos else frozenset())


def params_per_prompt(prompts: Sequence, params) -> list:
    """One ``SamplingParams`` per prompt from ``params`` (one for all, or one per prompt);
    ``ValueError`` when ``prompts`` is no list, on a count that differs from the prompts' or
    an entry of another type."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of token-id lists")
    if isinstance(params, SamplingParams):
        plist = [params] * len(prompts)
    elif isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        plist = list(params)
    else:
        raise ValueError(f"params must be one SamplingParams or a list of them (one per prompt), "
                         f"got {type(params).__name__}")
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
    for i, p in enumerate(plist):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return plist


INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _int(v, what: str) -> int:
    """``v`` as a Python int (numpy / 0-d tensor ints accepted), else ``ValueError``."""
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point() and v.dtype != torch.bool:
        v = int(v)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    return int(v)


def _real(v, what: str) -> float:
    """``v`` as a finite float, else ``ValueError`` (strings, bools, NaN and inf refused)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what} must be a number, got {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {v!r}")
    return float(v)


@dataclass
class Sample:
    """One completion: generated ``token_ids``, their ``logprobs`` under the sampling
    distribution actually used (after temperature / top-k / top-p / min-p), and why it ended
    (``"stop"`` on a stop token, ``"length"`` at ``max_tokens`` or the model's window,
    ``"abort"`` when ``SamplingEngine.abort`` stopped it: the tokens sampled until then)."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str

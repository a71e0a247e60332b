"""Wire formats of the HTTP API: batches and token statistics as safetensors bytes, samples and
sampling parameters as JSON. Every decoder raises ``ValueError`` with a message that names the
bad field (the server turns it into a 400).

Batch tensors (safetensors, metadata ``{"format": "polynya.batch.v1"}``): ``prompt_ids`` /
``response_ids`` int64 ``[total]`` (all samples back to back) with ``prompt_lens`` /
``response_lens`` int64 ``[B]``; optional ``group_ids`` int64 ``[B]``, ``advantages`` float32
``[B]`` or ``[B, Rmax]``, ``old_logprobs`` / ``ref_logprobs`` float32 ``[B, Rmax]``.
Token statistics: ``logprobs`` float32 ``[B, Rmax]``, ``mask`` bool ``[B, Rmax]``, optional
``entropy`` float32 ``[B, Rmax]``. Metrics (``/rl/forward_backward``, ``/rl/step``): a JSON
object of numbers, with a non-finite one as the string ``"inf"``, ``"-inf"`` or ``"nan"`` (JSON
has no such numbers; a skipped step's ``grad_norm`` is one).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..types import RolloutBatch, Sample, SamplingParams, TokenStats

BATCH_FORMAT = "polynya.batch.v1"
STATS_FORMAT = "polynya.stats.v1"
_INT = (torch.int64, torch.int32)
_FLOAT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def encode_batch(batch: RolloutBatch) -> bytes:
    t = {
        "prompt_ids": torch.from_numpy(_cat(batch.prompts)),
        "prompt_lens": torch.tensor([p.size for p in batch.prompts], dtype=torch.int64),
        "response_ids": torch.from_numpy(_cat(batch.responses)),
        "response_lens": torch.tensor([r.size for r in batch.responses], dtype=torch.int64),
    }
    if batch.group_ids is not None:
        t["group_ids"] = torch.tensor(batch.group_ids, dtype=torch.int64)
    for name in ("advantages", "old_logprobs", "ref_logprobs"):
        v = getattr(batch, name)
        if v is not None:
            t[name] = v.detach().float().cpu().contiguous()
    return st_save(t, metadata={"format": BATCH_FORMAT})


def _cat(arrays):
    import numpy as np

    return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, dtype=np.int64)


def _load(data: bytes, what: str) -> dict[str, torch.Tensor]:
    if not data:
        raise ValueError(f"empty body: expected {what} as safetensors bytes")
    try:
        return st_load(data)
    except Exception as exc:
        raise ValueError(f"body is not valid safetensors ({what}): {exc}") from None


def _get(
    t: dict, name: str, dtypes, ndim: int | None, required: bool = True
) -> torch.Tensor | None:
    if name not in t:
        if required:
            raise ValueError(f"missing tensor {name!r}")
        return None
    x = t[name]
    if x.dtype not in dtypes:
        raise ValueError(
            f"tensor {name!r} has dtype {x.dtype}; expected one of {[str(d) for d in dtypes]}"
        )
    if ndim is not None and x.dim() != ndim:
        raise ValueError(
            f"tensor {name!r} has shape {tuple(x.shape)}; expected {ndim} dimension(s)"
        )
    return x


def _split(flat: torch.Tensor, lens: torch.Tensor, what: str) -> list[torch.Tensor]:
    sizes = lens.tolist()  # Python ints: their sum cannot wrap around as an int64 sum can
    if any(n < 0 for n in sizes):
        raise ValueError(f"{what}_lens has negative entries")
    if sum(sizes) != flat.numel():
        raise ValueError(
            f"{what}_lens sum to {sum(sizes)} but {what}_ids holds {flat.numel()} tokens"
        )
    return list(flat.to(torch.int64).split(sizes))


def decode_batch(data: bytes) -> RolloutBatch:
    t = _load(data, "a RolloutBatch")
    unknown = set(t) - {
        "prompt_ids",
        "prompt_lens",
        "response_ids",
        "response_lens",
        "group_ids",
        "advantages",
        "old_logprobs",
        "ref_logprobs",
    }
    if unknown:
        raise ValueError(f"unknown tensors {sorted(unknown)}")
    p_lens = _get(t, "prompt_lens", _INT, 1)
    r_lens = _get(t, "response_lens", _INT, 1)
    if p_lens.numel() != r_lens.numel():
        raise ValueError(
            f"prompt_lens has {p_lens.numel()} samples, response_lens {r_lens.numel()}"
        )
    prompts = _split(_get(t, "prompt_ids", _INT, 1), p_lens, "prompt")
    responses = _split(_get(t, "response_ids", _INT, 1), r_lens, "response")
    groups = _get(t, "group_ids", _INT, 1, required=False)
    kw: dict[str, Any] = {"group_ids": None if groups is None else groups.tolist()}
    for name in ("advantages", "old_logprobs", "ref_logprobs"):
        kw[name] = _get(t, name, _FLOAT, None, required=False)
    return RolloutBatch(prompts, responses, **kw)  # shapes of the optional fields checked here


_NON_FINITE = ("inf", "-inf", "nan")  # how encode_metrics writes non-finite floats (repr)


def encode_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` for JSON: non-finite floats as ``"inf"`` / ``"-inf"`` / ``"nan"``."""
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items()}


def decode_metrics(body: dict[str, Any]) -> dict[str, Any]:
    """``encode_metrics`` undone (a string among ``inf``, ``-inf``, ``nan`` back to a float)."""
    return {k: (float(v) if v in _NON_FINITE else v) for k, v in body.items()}


def encode_stats(stats: TokenStats) -> bytes:
    t = {
        "logprobs": stats.logprobs.detach().float().cpu().contiguous(),
        "mask": stats.mask.detach().cpu().contiguous(),
    }
    if stats.entropy is not None:
        t["entropy"] = stats.entropy.detach().float().cpu().contiguous()
    return st_save(t, metadata={"format": STATS_FORMAT})


def decode_stats(data: bytes) -> TokenStats:
    t = _load(data, "TokenStats")
    lp = _get(t, "logprobs", (torch.float32,), 2)
    mask = _get(t, "mask", (torch.bool,), 2)
    ent = _get(t, "entropy", (torch.float32,), 2, required=False)
    return TokenStats(lp, ent, mask)


_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def params_from_json(d: Any, what: str = "params") -> SamplingParams:
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a JSON object of SamplingParams fields")
    unknown = set(d) - _PARAM_FIELDS
    if unknown:
        raise ValueError(f"{what}: unknown SamplingParams fields {sorted(unknown)}")
    return SamplingParams(**d)


GENERATE_FIELDS = ("prompts", "params")  # the body of POST /rl/generate, as HTTPClient sends it


def generate_from_json(body: dict[str, Any]) -> tuple[list[list[int]], SamplingParams | list[SamplingParams]]:
    """``/rl/generate``'s body: ``prompts`` and ``params`` (one object of ``SamplingParams``
    fields, or one per prompt; absent: the defaults). Any other key is a ``ValueError``: a
    misspelt ``params`` (or vLLM's ``sampling_params``) would otherwise sample with the defaults."""
    unknown = sorted(set(body) - set(GENERATE_FIELDS))
    if unknown:
        raise ValueError(f"/rl/generate: unknown field(s) {unknown}; the body holds "
                         f"{list(GENERATE_FIELDS)} (params: SamplingParams fields, or one such "
                         "object per prompt)")
    prompts = prompts_from_json(body.get("prompts"))
    raw = body.get("params", {})
    if isinstance(raw, list):
        return prompts, [params_from_json(p, f"params[{i}]") for i, p in enumerate(raw)]
    return prompts, params_from_json(raw)


def params_to_json(p: SamplingParams) -> dict:
    d = dataclasses.asdict(p)
    if d["stop_token_ids"] is not None:
        d["stop_token_ids"] = list(d["stop_token_ids"])
    return d


def sample_to_json(s: Sample) -> dict:
    return {
        "token_ids": list(s.token_ids),
        "logprobs": s.logprobs,
        "finish_reason": s.finish_reason,
    }


def sample_from_json(d: dict) -> Sample:
    return Sample(
        token_ids=list(d["token_ids"]), logprobs=d.get("logprobs"), finish_reason=d["finish_reason"]
    )


def prompts_from_json(prompts: Any) -> list[list[int]]:
    if not isinstance(prompts, list):  # empty: no samples, as from the local client
        raise ValueError("prompts must be a list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in p
        ):
            raise ValueError(f"prompts[{i}] must be a list of integer token ids")
    return prompts


async def read_json(request) -> dict:
    """The JSON object body of a request (HTTP 400 when it is not one)."""
    from fastapi import HTTPException

    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HTTPException(400, f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "the JSON body must be an object")
    return body

"""verl's no-padding batch <-> polynya's ``RolloutBatch`` / ``TokenStats``.

What the trainer hands an engine (``left_right_2_no_padding`` of its padded batch):
``input_ids`` / ``position_ids`` jagged ``[B, j]`` (prompt + response, no padding), the padded
``prompts`` / ``responses`` / ``attention_mask`` they came from (or jagged ``prompts`` /
``responses``), ``response_mask`` / ``loss_mask`` ``[B, Rmax]``, ``uid`` (one id per prompt
group), ``old_log_probs`` / ``advantages`` / ``ref_log_prob`` ``[B, Rmax]`` and ``temperature``.

``read_batch`` checks that and returns the samples as a ``RolloutBatch`` (groups from ``uid``)
plus the per-row lengths; ``jagged_logprobs`` puts per-response-token values back in verl's
layout: a jagged ``[B, j]`` tensor whose position ``t`` holds the value for token ``t + 1`` —
response token ``k`` of a row with prompt length ``P`` sits at ``P - 1 + k``. Prompt positions
carry 0 (polynya computes response tokens only; verl's RL losses read only response positions,
and SFT batches, whose loss reads prompt positions, are refused, as are rows with
``multi_modal_inputs``: verl's engines feed those to the model, polynya's reads token ids only).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from polynya import RolloutBatch


@dataclass(frozen=True)
class VerlRows:
    """The samples of a verl batch in polynya's form, and how to put results back."""

    batch: RolloutBatch
    prompt_lens: list[int]
    response_lens: list[int]
    temperature: float


def _get(data, key: str, default=None):
    from verl.utils import tensordict_utils as tu

    return tu.get(data, key, default=default)


def _lengths(data, b: int) -> tuple[list[int], list[int]]:
    prompts, responses = data.get("prompts", None), data.get("responses", None)
    if prompts is None or responses is None:
        raise ValueError("the verl batch needs 'prompts' and 'responses' (the trainer keeps them in "
                         "every actor batch) to tell prompt from response tokens")
    if prompts.is_nested:
        if not responses.is_nested:
            raise ValueError("'prompts' is jagged but 'responses' is not")
        return prompts.offsets().diff().tolist(), responses.offsets().diff().tolist()
    mask = data.get("attention_mask", None)
    if mask is None or mask.is_nested or mask.dim() != 2 or mask.shape[0] != b:
        raise ValueError("padded 'prompts' need the padded 'attention_mask' [B, P + R] beside them")
    if mask.shape[1] != prompts.shape[1] + responses.shape[1]:
        raise ValueError(f"attention_mask has {mask.shape[1]} columns; prompts + responses have "
                         f"{prompts.shape[1]} + {responses.shape[1]}")
    p = prompts.shape[1]
    return mask[:, :p].sum(1).tolist(), mask[:, p:].sum(1).tolist()


def _groups(data, b: int) -> list[int]:
    uid = data.get("uid", None)
    if uid is None:
        raise ValueError("the verl batch has no 'uid': polynya keeps prompt groups together (ZoRRo, "
                         "micro-batches) by uid; verl's trainer sets it for every prompt — a custom "
                         "caller must add data['uid'] (one id per prompt, shared by its responses)")
    ids = uid.tolist() if hasattr(uid, "tolist") else list(uid)
    if len(ids) != b:
        raise ValueError(f"'uid' has {len(ids)} entries for {b} samples")
    index: dict = {}
    return [index.setdefault(u, len(index)) for u in ids]


def _temperature(data, b: int) -> float:
    t = _get(data, "temperature", None)
    if t is None:
        raise ValueError("the verl batch has no 'temperature' (verl's trainer sets it from rollout.temperature; "
                         "log-probs depend on it)")
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1)
        if t.numel() not in (1, b) or not bool((t == t[0]).all()):
            raise ValueError("per-sample temperatures differ; polynya computes a batch at one temperature")
        t = float(t[0])
    t = float(t)
    if not t > 0:
        raise ValueError(f"temperature must be > 0, got {t}")
    return t


def _check_masks(data, response_lens: list[int]) -> None:
    b, rmax = len(response_lens), max(response_lens, default=0)
    for key in ("response_mask", "loss_mask"):
        m = data.get(key, None)
        if m is None:
            if key == "response_mask":
                raise ValueError("the verl batch has no 'response_mask'")
            continue
        if m.is_nested:
            raise ValueError(f"'{key}' is jagged (an SFT batch): polynya's deepspeed engine serves "
                             "RL actor / reference batches, whose masks are padded [B, Rmax]")
        if m.dim() != 2 or m.shape[0] != b or m.shape[1] < rmax:
            raise ValueError(f"'{key}' has shape {tuple(m.shape)}; the responses need [B={b}, >= {rmax}]")
        beyond = torch.arange(m.shape[1])[None, :] >= torch.tensor(response_lens)[:, None]
        if bool((m.bool() & beyond).any()):
            raise ValueError(f"'{key}' marks tokens past the end of a response (masks do not match "
                             "the responses)")


def _check_positions(data, ids) -> None:
    pos = data.get("position_ids", None)
    if pos is None:
        return
    if not pos.is_nested or pos.dim() != 2 or not torch.equal(pos.offsets(), ids.offsets()):
        raise ValueError("position_ids must be jagged [B, j] like input_ids (multimodal 3-D rope "
                         "positions are not supported by polynya's engine)")
    lens = ids.offsets().diff()
    want = torch.arange(int(lens.sum())) - torch.repeat_interleave(ids.offsets()[:-1], lens)
    if not torch.equal(pos.values().cpu().long(), want):
        raise ValueError("position_ids are not 0..L-1 in every sample; polynya computes positions itself "
                         "and does not support other layouts")


def _check_text_only(data) -> None:
    """verl's engines feed ``multi_modal_inputs`` (pixel values ...) to the model beside the
    tokens; polynya's engine reads token ids only, so a batch carrying any is refused (text-only
    rows carry none or an empty dict)."""
    inputs = _get(data, "multi_modal_inputs", None)
    if inputs is None:
        return
    rows = [getattr(row, "data", row) for row in (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
    if any(row is not None and not (isinstance(row, Mapping) and not row) for row in rows):
        raise ValueError("the verl batch carries 'multi_modal_inputs' (images / video / audio): polynya's "
                         "deepspeed engine computes log-probs from token ids only and would ignore them")


def read_batch(data) -> VerlRows:
    """Check a verl engine batch and return its samples as a ``RolloutBatch`` (``ValueError``
    naming the key for anything missing or inconsistent)."""
    if data is None or (len(data.batch_size) and data.batch_size[0] == 0):
        raise ValueError("the verl batch is empty")
    ids = data.get("input_ids", None)
    if ids is None or not ids.is_nested:
        raise ValueError("the verl batch needs jagged 'input_ids' (the trainer's no-padding layout)")
    b = ids.shape[0]
    if b == 0:
        raise ValueError("the verl batch is empty")
    prompt_lens, response_lens = _lengths(data, b)
    seq_lens = ids.offsets().diff().tolist()
    if len(prompt_lens) != b or [p + r for p, r in zip(prompt_lens, response_lens)] != seq_lens:
        raise ValueError("input_ids lengths differ from prompt + response lengths (attention_mask / "
                         "prompts / responses do not describe input_ids)")
    if min(prompt_lens) < 1:
        raise ValueError("every sample needs at least one prompt token")
    _check_masks(data, response_lens)
    _check_positions(data, ids)
    _check_text_only(data)
    groups = _groups(data, b)
    tokens = ids.values().tolist()
    starts = ids.offsets().tolist()
    prompts = [tokens[s:s + p] for s, p in zip(starts, prompt_lens)]
    responses = [tokens[s + p:s + p + r] for s, p, r in zip(starts, prompt_lens, response_lens)]
    first: dict[int, list[int]] = {}
    for g, p in zip(groups, prompts):
        if first.setdefault(g, p) != p:
            raise ValueError("samples with the same uid have different prompts; a uid must name one prompt")
    return VerlRows(RolloutBatch(prompts, responses, group_ids=groups), prompt_lens, response_lens,
                    _temperature(data, b))


def jagged_logprobs(values: torch.Tensor, rows: list[int], layout: VerlRows) -> torch.Tensor:
    """``[len(rows), Rmax]`` per-response-token values -> verl's jagged ``[len(rows), j]`` layout
    (differentiable: the loss's gradient flows back into ``values``)."""
    pieces, offsets = [], [0]
    for i, row in enumerate(rows):
        p, r = layout.prompt_lens[row], layout.response_lens[row]
        pieces += [values.new_zeros(p - 1), values[i, :r], values.new_zeros(1)]
        offsets.append(offsets[-1] + p + r)
    flat = torch.cat(pieces)
    return torch.nested.nested_tensor_from_jagged(flat, torch.tensor(offsets, device=flat.device))

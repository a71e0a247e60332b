"""SkyRL's ``TrainingInputBatch`` layout <-> polynya's ``RolloutBatch`` / ``TokenStats``.

SkyRL (``skyrl.train.dataset.preprocess.convert_prompts_responses_to_batch_tensors``) stores each
sample as one left-padded row ``[pad..., prompt, response]`` of ``sequences`` / ``attention_mask``
``[B, T]``, and every per-response-token tensor (``response_mask``, ``loss_mask``,
``advantages``, ``action_log_probs``, ``base_action_log_probs``) *right-aligned* in ``[B, R]``:
sample ``i``'s values are the last ``len_i`` columns. polynya keeps token lists and left-aligned
``[B, Rmax]`` tensors. Nothing here imports SkyRL: a ``TrainingInputBatch`` is a dict of tensors.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from polynya.types import RolloutBatch

_ALWAYS = ("sequences", "attention_mask", "response_mask")
# vision inputs SkyRL's model forward reads (``HFModelWrapper.forward``); polynya scores token ids
_VISION = ("pixel_values", "image_grid_thw")


def _lengths_right_aligned(mask: torch.Tensor, what: str) -> torch.Tensor:
    """Per-row count of a right-aligned 0/1 mask; ``ValueError`` unless each row is 0...0 1...1."""
    m = mask.bool()
    lens = m.sum(-1)
    cols = torch.arange(m.shape[1], device=m.device)
    want = cols[None, :] >= (m.shape[1] - lens)[:, None]
    if not torch.equal(m, want):
        bad = int((m != want).any(-1).nonzero()[0])
        raise ValueError(f"{what} row {bad} is not right-aligned (zeros then ones): {mask[bad].tolist()}")
    return lens


def rollout_from_training_batch(data: Mapping, *, with_advantages: bool = True,
                                with_ref: bool = False) -> RolloutBatch:
    """A ``RolloutBatch`` with SkyRL's samples in the same order.

    Args:
        data: a SkyRL ``TrainingInputBatch`` (or any mapping with its keys).
        with_advantages: carry ``advantages`` (as SkyRL's trainer left them, i.e. already scaled
            by its ``loss_reduction``) times ``loss_mask``, plus ``action_log_probs`` as the old
            log-probs; needs those keys.
        with_ref: carry ``base_action_log_probs`` as the reference log-probs.
    Returns:
        ``RolloutBatch`` (left-aligned ``[B, Rmax]`` tensors, ``Rmax`` = longest response).
    Raises:
        ValueError: a missing key, a row that is not SkyRL's layout (padding inside a row, an
            empty prompt or response), a ``loss_mask`` outside the response, vision inputs.
    """
    missing = [k for k in _ALWAYS if data.get(k) is None]
    if missing:
        raise ValueError(f"the SkyRL batch lacks {missing}")
    vision = [k for k in _VISION if data.get(k) is not None]
    if vision:
        raise ValueError(f"the SkyRL batch carries {vision} (images): polynya's engines score token "
                         "ids only, so the image tokens would be read as text; train vision-language "
                         "models with SkyRL's own workers")
    seqs, attn = data["sequences"], data["attention_mask"]
    if seqs.dim() != 2 or attn.shape != seqs.shape:
        raise ValueError(f"sequences {tuple(seqs.shape)} and attention_mask {tuple(attn.shape)} "
                         "must be the same [B, T]")
    seq_lens = _lengths_right_aligned(attn, "attention_mask")  # left padding only
    resp_lens = _lengths_right_aligned(data["response_mask"], "response_mask")
    if bool((resp_lens == 0).any()) or bool((resp_lens >= seq_lens).any()):
        bad = int(((resp_lens == 0) | (resp_lens >= seq_lens)).nonzero()[0])
        raise ValueError(f"sample {bad} needs a non-empty prompt and response "
                         f"(tokens {int(seq_lens[bad])}, response {int(resp_lens[bad])})")
    prompts, responses = [], []
    for row, n, r in zip(seqs.tolist(), seq_lens.tolist(), resp_lens.tolist()):
        real = row[len(row) - n:]
        prompts.append(real[:-r])
        responses.append(real[-r:])
    advantages = old = ref = None
    if with_advantages:
        for k in ("advantages", "loss_mask", "action_log_probs"):
            if data.get(k) is None:
                raise ValueError(f"the SkyRL batch lacks {k!r} (needed to train)")
        loss_mask = data["loss_mask"].to(torch.float32)
        if bool(((loss_mask != 0) & ~data["response_mask"].bool()).any()):
            raise ValueError("loss_mask is set outside the response tokens")
        advantages = from_right_aligned(data["advantages"].float() * loss_mask, resp_lens)
        old = from_right_aligned(data["action_log_probs"].float(), resp_lens)
    if with_ref:
        if data.get("base_action_log_probs") is None:
            raise ValueError("the SkyRL batch lacks 'base_action_log_probs' (the KL term needs them)")
        ref = from_right_aligned(data["base_action_log_probs"].float(), resp_lens)
    return RolloutBatch(prompts, responses, advantages=advantages, old_logprobs=old,
                        ref_logprobs=ref)


def from_right_aligned(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` right-aligned -> ``[B, max(lens)]`` left-aligned (zeros after each length)."""
    width = x.shape[1]
    rmax = int(lens.max())
    out = torch.zeros(x.shape[0], rmax, dtype=x.dtype)
    for i, n in enumerate(lens.tolist()):
        out[i, :n] = x[i, width - n:].cpu()
    return out


def to_right_aligned(x: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """polynya's left-aligned ``[B, Rmax]`` (``mask`` marks real tokens) -> SkyRL's right-aligned
    ``[B, width]`` with zeros in front."""
    lens = mask.sum(-1).tolist()
    if max(lens) > width:
        raise ValueError(f"a response of {max(lens)} tokens does not fit SkyRL's width {width}")
    out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
    for i, n in enumerate(lens):
        out[i, width - n:] = x[i, :n]
    return out

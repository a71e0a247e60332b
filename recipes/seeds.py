"""Sampling seeds of the recipes' prompts: one per (run seed, step, prompt position).

One seed for a whole step would give sample ``j`` of every prompt the same random stream (the
native sampler seeds sample ``j`` of a request from the request's seed and ``j`` only), so the
step's prompts would draw correlated rollouts. Each prompt gets its own seed instead, a hash of
where it is, so a step is reproducible however its prompts are routed across samplers.
"""
from __future__ import annotations

import dataclasses
import hashlib

from .. import SamplingParams


def prompt_seed(kind: str, seed: int, step: int, position: int) -> int:
    """A 63-bit seed for the prompt at ``position`` of ``step`` (``kind``: "train", "eval")."""
    digest = hashlib.blake2b(f"{kind}:{seed}:{step}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def per_prompt(params: SamplingParams, kind: str, seed: int, step: int, prompts: int) -> list[SamplingParams]:
    """``params`` for each of ``prompts`` prompts, each with its own ``prompt_seed``."""
    return [dataclasses.replace(params, seed=prompt_seed(kind, seed, step, k)) for k in range(prompts)]

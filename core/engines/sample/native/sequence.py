"""One sequence being generated: its tokens, KV-cache blocks and sampling state.

A request ``(prompt, SamplingParams(n=G))`` enters as ONE sequence whose prompt is prefilled
once; when that prefill's logits come back, the engine forks it into ``G`` sequences that share
every prompt block (``BlockManager.fork``). Each fork owns its own ``torch.Generator`` so
seeded sampling does not depend on how requests were batched or preempted.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from polynya.types import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # needs a prefill (new, or preempted: recompute)
    RUNNING = "running"  # has KV for all tokens but the last; decodes one token per step
    FINISHED = "finished"


@dataclass
class Sequence:
    """Token ids (prompt + completion so far), the block table, and per-sample state.

    ``num_cached_tokens`` counts the leading tokens whose KV the prefix cache already held at
    the last prefill; ``pending_forks`` is ``n - 1`` until the prompt's prefill has run.
    ``cache_epoch``: the block manager's epoch when its pages were allocated (pages of a
    sequence allocated before a prefix-cache reset are never keyed: their KV is stale).
    """

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    request_id: int
    sample_index: int = 0
    pending_forks: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    cache_epoch: int = 0
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    table_array: np.ndarray | None = None  # int32 copy of block_table; None when stale
    _uniforms: list[float] = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def completion(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold the KV of every token."""
        return (len(self.token_ids) + block_size - 1) // block_size

    def uniform(self, ahead: int = 0) -> float:
        """The current U[0, 1) draw of this sequence's generator (drawn 64 at a time); it stays
        current until ``advance_uniform``, called once the token it sampled is kept, so a step
        that is never booked (a failed one) uses up nothing. ``ahead=1``: the draw after it
        (for a step launched before the current one is booked)."""
        while len(self._uniforms) <= ahead:  # stored last-first: later draws go in front
            self._uniforms[:0] = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self._uniforms[-1 - ahead]

    def advance_uniform(self) -> None:
        self._uniforms.pop()

    def table_np(self) -> np.ndarray:
        """``block_table`` as an int32 array, rebuilt only after the block manager changed it."""
        if self.table_array is None:
            self.table_array = np.asarray(self.block_table, dtype=np.int32)
        return self.table_array

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def fork(self, sample_index: int, generator: torch.Generator) -> Sequence:
        """A copy sharing this sequence's tokens; blocks are shared by the block manager."""
        return Sequence(token_ids=list(self.token_ids), num_prompt_tokens=self.num_prompt_tokens,
                        params=self.params, stop_ids=self.stop_ids, generator=generator,
                        request_id=self.request_id, sample_index=sample_index,
                        status=self.status, num_cached_tokens=self.num_cached_tokens,
                        logprobs=list(self.logprobs))

"""The client interface every protocol implements, and helpers shared by the implementations.

``RLClient`` (a ``Protocol``) lists the calls; ``ThreadedAsync`` gives a client whose sync calls
block on local work an ``async`` twin of each that runs it on a worker thread
(``asyncio.to_thread``), so the event loop never blocks. ``ENGINES`` names what ``sleep`` /
``wake`` act on.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, Sequence

from ..coordination import ENGINES, check_engine  # noqa: F401  (part of the client API)
from ..types import RolloutBatch, Sample, SamplingParams, TokenSeq, TokenStats

LOGPROB_MODELS = ("policy", "reference")


class EngineError(RuntimeError):
    """An engine (actor, server) failed or did not answer in time."""


def check_logprob_model(model: str) -> str:
    if model not in LOGPROB_MODELS:
        raise ValueError(f"model must be one of {LOGPROB_MODELS}, got {model!r}")
    return model


class RLClient(Protocol):
    """What ``polynya.create_rl_client`` returns (every protocol; ``*_async`` twins too)."""

    def generate(
        self, prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[Sample]]: ...
    def compute_logprobs(
        self,
        batch: RolloutBatch,
        *,
        model: str = "policy",
        entropy: bool = False,
        temperature: float | None = None,
    ) -> TokenStats: ...
    def forward_backward(self, batch: RolloutBatch) -> dict[str, float]: ...
    def step(self) -> dict[str, float]: ...
    def sync_weights(self) -> dict[str, Any]: ...
    def sleep(self, engine: str = "sampler", level: int = 1) -> None: ...
    def wake(self, engine: str = "sampler") -> None: ...
    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...
    def weight_checksums(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...


class ClientLifecycle:
    """``shutdown_async`` and the sync/async context managers every client shares."""

    async def shutdown_async(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown_async()


class ThreadedAsync(ClientLifecycle):
    """``*_async`` twins that run the blocking call on a worker thread."""

    async def generate_async(self, prompts, params) -> list[list[Sample]]:
        return await asyncio.to_thread(self.generate, prompts, params)

    async def compute_logprobs_async(self, batch: RolloutBatch, **kw) -> TokenStats:
        return await asyncio.to_thread(lambda: self.compute_logprobs(batch, **kw))

    async def forward_backward_async(self, batch: RolloutBatch) -> dict[str, float]:
        return await asyncio.to_thread(self.forward_backward, batch)

    async def step_async(self) -> dict[str, float]:
        return await asyncio.to_thread(self.step)

    async def sync_weights_async(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync_weights)

    async def sleep_async(self, engine: str = "sampler", level: int = 1) -> None:
        return await asyncio.to_thread(self.sleep, engine, level)

    async def wake_async(self, engine: str = "sampler") -> None:
        return await asyncio.to_thread(self.wake, engine)

    async def save_async(self, path: str) -> None:
        return await asyncio.to_thread(self.save, path)

    async def load_async(self, path: str) -> None:
        return await asyncio.to_thread(self.load, path)

    async def weight_checksums_async(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.weight_checksums)


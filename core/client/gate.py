"""``GenerationGate``: the pause/resume state of the HTTP server's generation routes.

Every generation route of ``polynya.client.server`` runs its engine call through one gate::

    gate = GenerationGate()
    out = await gate.run(lambda: client.generate_async(prompts, params))
    await gate.pause("wait")      # no new request starts; returns once none is in flight
    gate.resume()

Pause modes, as vLLM's ``/pause?mode=`` (which SkyRL's ``RemoteInferenceClient.pause`` sends):

- ``"keep"`` (SkyRL's default, ``pause_generation``): new requests wait for ``resume``; requests
  already running keep running. The sampler swaps weights atomically between two engine steps,
  so a weight update during the pause never exposes a half-updated model to them (vLLM instead
  freezes them; either way a response may span two weight versions, each token's log-prob
  being the one of the weights that sampled it).
- ``"wait"``: as ``keep``, and ``pause`` returns only when no request is in flight any more.
- ``"abort"``: refused (``NotImplementedError``): the sampler cannot stop a running request
  and hand back its partial tokens; use ``keep`` or ``wait``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
PAUSE_MODES = ("keep", "wait", "abort")


class GenerationGate:
    """Holds new generation while paused and counts the requests in flight."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def run(self, call: Callable[[], Awaitable[T]]) -> T:
        """Wait while paused, then run ``call()`` counted as in flight."""
        await self._open.wait()
        self._in_flight += 1
        self._idle.clear()
        try:
            return await call()
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def pause(self, mode: str = "keep") -> None:
        """Stop new requests from starting (see the module docstring for ``mode``)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort":
            raise NotImplementedError(
                "pause mode 'abort' is not supported: polynya's sampler cannot stop a running "
                "request and return its partial tokens; pause with mode='keep' (in-flight "
                "requests finish, new ones wait) or mode='wait' (returns once none is in flight)"
            )
        self._open.clear()
        if mode == "wait":
            await self._idle.wait()

    def resume(self) -> None:
        self._open.set()

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
- ``"abort"``: as ``keep``, and every request in flight is aborted (``abort``, the engines'
  ``SamplingEngine.abort``): each answers at once with its partial tokens and log-probs and
  ``finish_reason="abort"``, as vLLM's do; ``pause`` returns once none is in flight. A request
  that passed the gate but reached its engine only after an abort is aborted by the next round.
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

    async def pause(self, mode: str = "keep",
                    abort: Callable[[], Awaitable[object]] | None = None) -> None:
        """Stop new requests from starting (see the module docstring for ``mode``); ``abort``
        stops every engine request in flight (needed by mode ``"abort"``)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort" and abort is None:
            raise NotImplementedError("pause mode 'abort' needs engines that can abort requests")
        was_open = self._open.is_set()
        self._open.clear()
        if mode == "wait":
            await self._idle.wait()
        elif mode == "abort":
            try:
                while not self._idle.is_set():
                    await abort()
                    try:  # an aborted request answers within a step; one that reached its
                        await asyncio.wait_for(self._idle.wait(), 0.05)  # engine late: next round
                    except asyncio.TimeoutError:
                        pass
            except BaseException:
                if was_open:  # a failed abort leaves the gate as it was
                    self._open.set()
                raise

    def resume(self) -> None:
        self._open.set()

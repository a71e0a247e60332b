"""Generation for an HTTP request that stops when its client goes away.

uvicorn does not cancel a route handler whose client disconnected: a plain (non-streaming) route
would decode to ``max_tokens`` for nobody and hold its KV pages until then. ``Generations``
runs each route's engine call (``client.generate_async``) next to a task that waits for the
ASGI ``http.disconnect`` message (the next ``receive()`` after the body was read returns it as
soon as the connection closes). On a disconnect, or when the handler task itself is cancelled,
the engine call is cancelled; ``LocalClient.generate_async`` then aborts its engine requests —
all its prompts and their ``n`` samples — at the next engine step boundary (pages freed; the
other requests of the batch go on unchanged) and returns only once the engine let go of them,
so the pause gate counts the call until then. The route ends with ``ClientDisconnected``
(answered 499, which nobody reads). This is what vLLM's server does (``with_cancellation`` /
``listen_for_disconnect``).

    generations = Generations(client)
    out = await generations(request, prompts, params, gate=gate)   # gate: GenerationGate or None

A client whose ``generate_async`` does not abort on cancellation (the Ray client) is still
watched: its handler ends on a disconnect, but its engine requests run to the end.
"""
from __future__ import annotations

import asyncio

from .gate import GenerationGate


class ClientDisconnected(Exception):
    """The HTTP client went away before its generation finished (its requests were aborted)."""


async def until_disconnected(request) -> None:
    """Return once the ASGI server reports the client gone (call after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Generations:
    """A server's generation calls, each aborted when its HTTP client disconnects."""

    def __init__(self, client) -> None:
        self.client = client

    async def __call__(self, request, prompts, params, *, gate: GenerationGate | None = None):
        """``client.generate_async(prompts, params)`` through ``gate`` (None: not pausable),
        aborted when ``request``'s client disconnects (None: not watched)."""
        def call():
            return self.client.generate_async(prompts, params)

        work = asyncio.ensure_future(gate.run(call) if gate is not None else call())
        watch = None if request is None else asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait([t for t in (work, watch) if t is not None],
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the handler itself was cancelled: stop its requests
            await _cancel(work)
            raise
        finally:
            if watch is not None:
                watch.cancel()
        if work.done():
            return work.result()
        await _cancel(work)
        raise ClientDisconnected("the client disconnected; its generation was aborted")


async def _cancel(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait until it has finished cleaning up (its abort included)."""
    task.cancel()
    await asyncio.wait([task])

"""Generation for an HTTP request that stops when its client goes away.

uvicorn does not cancel a route handler whose client disconnected: a plain (non-streaming) route
would decode to ``max_tokens`` for nobody and hold its KV pages until then. ``Generations``
runs each route's engine call as a named call (``LocalClient.generate(..., request_id=)``)
next to a task that waits for the ASGI ``http.disconnect`` message (the next ``receive()``
after the body was read returns it as soon as the connection closes). On a disconnect, or when
the handler task itself is cancelled, the engine requests of that call — all its prompts and
their ``n`` samples — are aborted (``LocalClient.abort([request_id])``: at the next engine step
boundary, pages freed; the other requests of the batch go on unchanged) and the route ends with
``ClientDisconnected`` (answered 499, which nobody reads). This is what vLLM's server does
(``with_cancellation`` / ``listen_for_disconnect``).

    generations = Generations(client)
    out = await generations(request, prompts, params, gate=gate)   # gate: GenerationGate or None

A client without ``abort`` (the Ray client) is still watched: its handler ends on a disconnect,
but its engine requests run to the end.
"""
from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

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

    def __init__(self, client, abort_threads: int = 2) -> None:
        self.client = client
        self.abortable = callable(getattr(client, "abort", None))
        # an abort waits for an engine step boundary: on threads of its own, since the default
        # executor may be full of the very generate calls it has to stop
        self._pool = ThreadPoolExecutor(abort_threads, thread_name_prefix="polynya-abort")

    async def __call__(self, request, prompts, params, *, gate: GenerationGate | None = None):
        """``client.generate_async(prompts, params)`` through ``gate`` (None: not pausable),
        aborted when ``request``'s client disconnects (None: not watched)."""
        call = self._engine_call(prompts, params)
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

    def _engine_call(self, prompts, params):
        if not self.abortable:
            return lambda: self.client.generate_async(prompts, params)
        request_id = f"http-{uuid.uuid4().hex}"

        async def call():
            engine = asyncio.ensure_future(
                self.client.generate_async(prompts, params, request_id=request_id))
            try:
                return await asyncio.shield(engine)
            except asyncio.CancelledError:  # abort, and count the call in flight until it ends
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._pool, self.client.abort, [request_id])
                await asyncio.wait([engine])
                if not engine.cancelled():
                    engine.exception()  # retrieved: nobody is left to read it
                raise

        return call

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


async def _cancel(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait until it has finished cleaning up (its abort included)."""
    task.cancel()
    await asyncio.wait([task])

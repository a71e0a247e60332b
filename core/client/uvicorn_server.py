"""How polynya runs uvicorn: the same protocol and config for the standalone server
(``server.main``) and the one ``HTTPClient`` starts in its own process.

uvicorn bounds no wait for a request's line and headers: its ``timeout_keep_alive`` is armed
only when a response completes and is cancelled by the first byte of the next request, so a
connection that sends nothing, or sends its headers a byte at a time, is held for ever.
``HeaderDeadline`` is uvicorn's h11 protocol with that bound added (``--header-timeout``):

- a timer starts when a connection opens and, on a keep-alive connection, when a response ends;
  it stops once h11 holds the next request's line and headers. So it never runs while a route
  does or while the body of a request being answered arrives (``BodyGuard`` bounds that), but
  it does run while a client sends the rest of a body its answer did not wait for (a 413);
- trickling does not extend it: the deadline is fixed when the wait starts;
- when it passes with part of a request received, the client gets 408 with ``Connection:
  close`` (Apache's ``mod_reqtimeout`` answers the same); otherwise the connection is closed
  without a word, as uvicorn's keep-alive timeout closes it (a 408 on a connection with no
  request in flight can be read by a client that sends one just then as that request's answer).

The server pins h11: ``http="auto"`` would pick httptools where it is installed, h11 always is
(uvicorn depends on it). One protocol to extend and test, the same parser whichever extras a
machine has; parsing is not what this server spends its time on.

    server, thread = start_in_thread(server_config(app, "127.0.0.1", port, header_timeout_s=10))
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .api import EngineError
from .guard import HEADER_TIMEOUT_S


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers (module
    docstring); ``header_deadline`` makes the class for one timeout. A subclass because the
    protocol class is the only hook uvicorn offers below the ASGI app, which sees a request only
    once its headers are in."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already received
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Start the timer when the server has no request to answer (h11: ours idle or done),
        stop it when it has one."""
        waiting = (self.conn.our_state in (h11.IDLE, h11.DONE)
                   and not self.transport.is_closing())
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)
        elif not waiting:
            self._stop_header_timer()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        received = len(self.conn.trailing_data[0])  # of a request line and headers
        if received and self.conn.our_state is h11.IDLE:  # not after an answer to the last one
            self._send_408(received)
        self.transport.close()

    def _send_408(self, received: int) -> None:
        body = json.dumps({"error": f"request line and headers not complete within "
                                    f"{self.header_timeout_s:g} s ({received} bytes received)"})
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                      h11.Data(data=body.encode()), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))


def header_deadline(timeout_s: float = HEADER_TIMEOUT_S) -> type[HeaderDeadline]:
    """``HeaderDeadline`` with ``timeout_s`` seconds for a request's line and headers (uvicorn
    builds the protocol itself, so the number travels as a class attribute)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not 0 < timeout_s < math.inf:
        raise ValueError(f"header_timeout_s must be > 0 seconds (finite), got {timeout_s!r}")
    return type("HeaderDeadline", (HeaderDeadline,), {"header_timeout_s": float(timeout_s)})


def server_config(app, host: str, port: int, *, header_timeout_s: float = HEADER_TIMEOUT_S,
                  **kwargs) -> uvicorn.Config:
    """uvicorn's config for a polynya server: h11 with the header deadline, warnings only;
    ``kwargs`` go to ``uvicorn.Config`` (``lifespan="off"``, ...)."""
    return uvicorn.Config(app, host=host, port=port, http=header_deadline(header_timeout_s),
                          log_level="warning", **kwargs)


def start_in_thread(config: uvicorn.Config, name: str = "polynya-http",
                    wait_s: float = 30.0) -> tuple[uvicorn.Server, threading.Thread]:
    """uvicorn serving ``config`` on a daemon thread, returned once it listens (stop it with
    ``server.should_exit = True`` and a join); ``EngineError`` if it does not start."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + wait_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True  # one still starting stops once it is up
            raise EngineError(f"the polynya server on {config.host}:{config.port} did not start")
        time.sleep(0.02)
    return server, thread

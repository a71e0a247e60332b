"""``BodyGuard`` on its own (ASGI, no server): size, idle and average-rate bounds of a request
body, and the body replayed intact to the app when it passes. The same bounds through a real
uvicorn socket: ``test_transport.py``."""

from __future__ import annotations

import asyncio
import json

import pytest
from polynya.client.guard import BodyGuard


class App:
    """Records the body it was given (the guard replays it) and answers 200."""

    def __init__(self):
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        msg = await receive()
        self.bodies.append(msg["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def run(guard: BodyGuard, chunks: list[bytes], gap_s: float, *, declared: int | None = None):
    """Feed ``chunks`` ``gap_s`` apart; (status, JSON error or None, seconds taken)."""

    async def main():
        sent: list[dict] = []
        queue = list(chunks)

        async def receive():
            await asyncio.sleep(gap_s)
            body = queue.pop(0) if queue else b""
            return {"type": "http.request", "body": body, "more_body": bool(queue)}

        async def send(msg):
            sent.append(msg)

        headers = [] if declared is None else [(b"content-length", str(declared).encode())]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await guard({"type": "http", "headers": headers}, receive, send)
        status = sent[0]["status"]
        error = json.loads(sent[1]["body"])["error"] if status != 200 else None
        return status, error, loop.time() - t0

    return asyncio.run(main())


def test_fast_body_is_replayed_whole():
    app = App()
    guard = BodyGuard(app, limit=1 << 20, read_timeout_s=1.0, min_rate=1024)
    chunks = [bytes([i]) * 1000 for i in range(5)]
    status, error, _ = run(guard, chunks, 0.001)
    assert (status, error) == (200, None)
    assert app.bodies == [b"".join(chunks)]


def test_trickled_body_gets_408_at_its_rate_deadline():
    app = App()
    guard = BodyGuard(app, limit=1 << 20, read_timeout_s=0.2, min_rate=100)
    # one byte every 0.05 s: never idle for 0.2 s, but 20 bytes/s against a minimum of 100
    status, error, took = run(guard, [b"x"] * 40, 0.05)
    assert status == 408 and "too slow" in error and "100 bytes/s" in error, error
    assert app.bodies == []  # the route never ran
    assert 0.2 <= took < 0.2 + 40 / 100  # cut near 0.2 s + bytes / rate, long before the body ends


def test_no_rate_bound_when_min_rate_is_zero():
    app = App()
    guard = BodyGuard(app, limit=1 << 20, read_timeout_s=0.2, min_rate=0)
    status, error, took = run(guard, [b"x"] * 8, 0.05)
    assert (status, error) == (200, None) and app.bodies == [b"x" * 8]
    assert took >= 8 * 0.05


def test_idle_body_gets_408_naming_the_idle_timeout():
    app = App()
    guard = BodyGuard(app, limit=1 << 20, read_timeout_s=0.1, min_rate=1024)
    status, error, _ = run(guard, [b"x", b"y"], 0.3)  # nothing for 0.3 s > 0.1 s
    assert status == 408 and "no request body data for 0.1 s" in error, error
    assert app.bodies == []


def test_oversized_bodies_get_413_declared_or_streamed():
    app = App()
    guard = BodyGuard(app, limit=100, read_timeout_s=1.0)
    assert run(guard, [b"x" * 10], 0.0, declared=101)[0] == 413
    status, error, _ = run(guard, [b"x" * 60, b"y" * 60], 0.0)
    assert status == 413 and "limit of 100" in error
    assert app.bodies == []


@pytest.mark.parametrize("kwargs, needle", [
    ({"read_timeout_s": 0}, "read_timeout_s"),
    ({"read_timeout_s": float("nan")}, "read_timeout_s"),
    ({"read_timeout_s": float("inf")}, "read_timeout_s"),
    ({"read_timeout_s": 1.0, "min_rate": -1}, "min_rate"),
    ({"read_timeout_s": 1.0, "min_rate": float("nan")}, "min_rate"),
    ({"read_timeout_s": 1.0, "min_rate": float("inf")}, "min_rate"),
    ({"read_timeout_s": 1.0, "limit": -1}, "limit"),
    ({"read_timeout_s": 1.0, "limit": 1.5}, "limit"),
])
def test_bad_bounds_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        BodyGuard(App(), **{"limit": 100, **kwargs})

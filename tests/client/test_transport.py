"""Request bodies through a real uvicorn socket (the server of ``test_faults.py``): a body
shorter than its Content-Length gets 408 after the read timeout, one trickled a byte at a time
(never idle) gets 408 at the minimum average rate; the server keeps serving and its state is
unchanged. ``BodyGuard`` alone: ``test_body_guard.py``."""

from __future__ import annotations

import json
import socket
import time

import httpx

from .test_faults import READ_TIMEOUT_S, TOKEN, planted, server, unchanged  # noqa: F401

def _slow_post(server, length: int, start: bytes, trickle_s: float | None):
    """POST ``start`` of a ``length``-byte body on a raw socket, then (``trickle_s``) one more
    byte each ``trickle_s`` until the server answers; (status line and headers, JSON error,
    seconds from the first body bytes to the answer)."""
    port = int(server["url"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            b"POST /rl/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(length).encode() + b"\r\n\r\n" + start
        )
        t0 = time.monotonic()
        s.settimeout(trickle_s or 30)
        reply = b""
        for _ in range(200):  # at most 200 trickled bytes; the server answers long before
            try:
                reply = s.recv(4096)
                break
            except TimeoutError:
                s.sendall(b" ")
        waited = time.monotonic() - t0
        s.settimeout(30)
        while chunk := s.recv(4096):  # the server closes the connection after its answer
            reply += chunk
    head, _, body = reply.decode().partition("\r\n\r\n")
    return head, json.loads(body)["error"], waited


def test_short_body_times_out_with_408(server, unchanged):
    head, error, waited = _slow_post(server, 100, b'{"prompts"', None)
    assert head.startswith("HTTP/1.1 408") and "connection: close" in head.lower(), head
    assert "Content-Length" in error
    assert READ_TIMEOUT_S * 0.9 <= waited < READ_TIMEOUT_S + 5
    assert httpx.get(server["url"] + "/health", timeout=30).status_code == 200


def test_trickled_body_gets_408_at_the_minimum_rate(server, unchanged):
    """One byte every READ_TIMEOUT_S / 4 is never idle long enough for the read timeout; the
    average-rate bound (1024 bytes/s after the first READ_TIMEOUT_S) ends it near 1 s."""
    head, error, waited = _slow_post(server, 1000, b"{", READ_TIMEOUT_S / 4)
    assert head.startswith("HTTP/1.1 408") and "connection: close" in head.lower(), head
    assert "too slow" in error, error
    assert READ_TIMEOUT_S * 0.9 <= waited < READ_TIMEOUT_S + 5
    assert httpx.get(server["url"] + "/health", timeout=30).status_code == 200

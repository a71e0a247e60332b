"""The deadline on a request's line and headers (``--header-timeout``, ``uvicorn_server.py``),
through real sockets on 127.0.0.1 against uvicorn with the server's protocol and a 0.5 s
deadline: a connection that sends nothing is closed at the deadline, one that trickles its
headers gets 408 at the deadline although it keeps sending, an idle keep-alive connection and
one trickling the body of an already answered request are closed at the deadline after the
response; requests on one keep-alive connection a pause apart each get their own deadline, a
body and a route may take longer than it, other clients are served meanwhile. Then the wiring:
the command line (bounds, a usage error before any model loads, the flag reaching the server)
and the server ``HTTPClient`` starts."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest
from polynya import SamplingParams
from polynya.client import guard
from polynya.client.http_client import HTTPClient
from polynya.client.server import parser
from polynya.client.uvicorn_server import (
    HeaderDeadline,
    header_deadline,
    server_config,
    start_in_thread,
)
from polynya.distributed import free_port

from .common import tiny_config

DEADLINE_S = 0.5
SLACK_S = 1.0  # scheduling noise allowed past a deadline
LONG_ROUTE_S = 3 * DEADLINE_S
GET = b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"


async def app(scope, receive, send):
    """Echoes the path and body as JSON; ``/slow`` first waits ``LONG_ROUTE_S``, ``/early``
    answers without reading the body."""
    if scope["type"] != "http":
        return
    body, more = b"", scope["path"] != "/early"
    while more:
        msg = await receive()
        body, more = body + msg.get("body", b""), msg.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(LONG_ROUTE_S)
    out = json.dumps({"path": scope["path"], "body": body.decode()}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def port():
    port = free_port()
    server, thread = start_in_thread(
        server_config(app, "127.0.0.1", port, header_timeout_s=DEADLINE_S, lifespan="off"))
    yield port
    server.should_exit = True
    thread.join(10)


def read_response(s: socket.socket) -> tuple[str, dict]:
    """One whole response from ``s``, not a byte past it (a pipelined one may follow):
    (status line and headers, JSON body)."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = s.recv(1)
        assert byte, f"closed after {head!r}"
        head += byte
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    body = b""
    while len(body) < length:
        body += s.recv(length - len(body))
    return head.decode(), json.loads(body)


def until_closed(s: socket.socket) -> tuple[bytes, float]:
    """What ``s`` receives until the server closes it, and when it closed (monotonic)."""
    s.settimeout(LONG_ROUTE_S + 10)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic()


def trickle(s: socket.socket, request: bytes, gap_s: float) -> int:
    """Send ``request`` a byte each ``gap_s`` until the server answers or closes; bytes sent."""
    sent = 0
    while sent < len(request) and not select.select([s], [], [], gap_s)[0]:
        try:
            s.sendall(request[sent:sent + 1])
        except ConnectionError:
            break
        sent += 1
    return sent


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_silent_connection_closed_at_the_deadline(port):
    with connect(port) as s:
        t0 = time.monotonic()
        reply, closed = until_closed(s)
    assert reply == b""  # nothing of a request came, so no answer: closed without a word
    assert DEADLINE_S * 0.9 <= closed - t0 < DEADLINE_S + SLACK_S


def test_trickled_headers_get_408_at_the_deadline_although_they_keep_coming(port):
    request = b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 300 + b"\r\n\r\n"
    with connect(port) as s:
        t0 = time.monotonic()
        sent = trickle(s, request, DEADLINE_S / 10)
        reply, closed = until_closed(s)
    head, _, body = reply.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 408") and "connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert "not complete within 0.5 s" in error and f"{sent} bytes received" in error, error
    assert 5 <= sent < len(request)  # it was still sending when the deadline passed
    assert DEADLINE_S * 0.9 <= closed - t0 < DEADLINE_S + SLACK_S


def test_idle_keep_alive_connection_closed_at_the_deadline_after_its_response(port):
    """Sooner than uvicorn's own keep-alive timeout (5 s), without a 408 (nothing came)."""
    with connect(port) as s:
        s.sendall(GET)
        assert read_response(s)[0].startswith("HTTP/1.1 200")
        t0 = time.monotonic()
        reply, closed = until_closed(s)
    assert reply == b"" and DEADLINE_S * 0.9 <= closed - t0 < DEADLINE_S + SLACK_S


def test_body_left_after_an_early_answer_is_cut_at_the_deadline(port):
    """An answer that did not wait for the body (as a 413 does) leaves the connection open
    for the rest of it; that counts as waiting for the next request, trickled or not."""
    with connect(port) as s:
        s.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        assert read_response(s)[1] == {"path": "/early", "body": ""}
        t0 = time.monotonic()
        assert trickle(s, b"x" * 999, DEADLINE_S / 10) < 999
        reply, closed = until_closed(s)
    assert reply == b""  # no second answer to the request already answered
    assert DEADLINE_S * 0.9 <= closed - t0 < DEADLINE_S + SLACK_S


def test_requests_a_pause_apart_on_one_keep_alive_connection(port):
    """Each wait (0.3 s, headers in two writes) is within the deadline, their sum is not: the
    deadline restarts at each response. Two pipelined requests are both answered."""
    half = len(GET) // 2
    with connect(port) as s:
        for i in range(4):
            time.sleep(0.2)
            s.sendall(GET[:half].replace(b"/echo", f"/r{i}".encode()))
            time.sleep(0.1)
            s.sendall(GET[half:])
            head, body = read_response(s)
            assert head.startswith("HTTP/1.1 200") and body["path"] == f"/r{i}", (head, body)
        s.sendall(GET.replace(b"/echo", b"/p1") + GET.replace(b"/echo", b"/p2"))
        assert [read_response(s)[1]["path"] for _ in range(2)] == ["/p1", "/p2"]


def test_long_route_and_slow_body_are_not_cut_by_the_header_deadline(port):
    """Once the headers are in the timer stops: a route taking 3x the deadline answers, and so
    does a body arriving over 2x it (bodies are ``BodyGuard``'s to bound); the connection then
    serves the next request."""
    with connect(port) as s:
        s.sendall(GET.replace(b"/echo", b"/slow"))
        t0 = time.monotonic()
        head, body = read_response(s)
        assert head.startswith("HTTP/1.1 200") and body["path"] == "/slow"
        assert time.monotonic() - t0 >= LONG_ROUTE_S * 0.9
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
        for byte in b"abcd":
            time.sleep(DEADLINE_S / 2)
            s.sendall(bytes([byte]))
        head, body = read_response(s)
        assert head.startswith("HTTP/1.1 200") and body == {"path": "/echo", "body": "abcd"}
        s.sendall(GET)
        assert read_response(s)[1]["path"] == "/echo"


def test_slow_header_connections_do_not_hold_other_clients(port):
    slow = [connect(port) for _ in range(20)]
    for s in slow[::2]:
        s.sendall(b"GET /echo HTTP/1.1\r\nHost:")  # half a request, then nothing
    t0 = time.monotonic()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        for i in range(10):
            assert http.get(f"/c{i}").json()["path"] == f"/c{i}"
    assert time.monotonic() - t0 < DEADLINE_S  # all served while the slow ones were waiting
    replies = []
    for s in slow:
        with s:
            replies.append(until_closed(s)[0])
    assert all(r.startswith(b"HTTP/1.1 408") for r in replies[::2])
    assert all(r == b"" for r in replies[1::2])


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "10", None])
def test_bad_deadlines_refused(value):
    with pytest.raises(ValueError, match="header_timeout_s"):
        header_deadline(value)


# ---------------------------------------------------------------- the command line

@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e999", "soon"])
def test_bad_header_timeouts_are_argparse_errors(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["--model", "tiny:qwen3", "--header-timeout", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --header-timeout: must be" in err and "> 0 seconds (finite)" in err


def test_header_timeout_default_and_given():
    assert parser().parse_args(["--model", "m"]).header_timeout == guard.HEADER_TIMEOUT_S == 10.0
    assert parser().parse_args(["--model", "m", "--header-timeout", "0.25"]).header_timeout == 0.25


def _server_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "polynya.client.server", "--model", "tiny:qwen3", *args]


def test_cli_refuses_a_zero_header_timeout_before_loading_anything():
    proc = subprocess.run(_server_cli("--header-timeout", "0"), check=False, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert "usage: python -m polynya.client.server" in proc.stderr
    assert "error: argument --header-timeout: must be > 0 seconds (finite), got 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_server_keeps_its_header_timeout(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        _server_cli("--dtype", "float32", "--port", str(port), "--run-dir", str(tmp_path),
                    "--header-timeout", str(DEADLINE_S), "--config-json",
                    '{"train": {"zero_stage": 2}, "sampling": {"num_blocks": 16}}'),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        while "ready at" not in (line := proc.stdout.readline()):
            assert line, "the server exited before it was ready"
        with connect(port) as s:
            t0 = time.monotonic()
            assert trickle(s, GET.replace(b"\r\n\r\n", b"X" * 300), DEADLINE_S / 10) >= 5
            reply, closed = until_closed(s)
        assert reply.startswith(b"HTTP/1.1 408")
        assert DEADLINE_S * 0.9 <= closed - t0 < DEADLINE_S + SLACK_S
        assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}
    finally:
        proc.terminate()
        proc.wait(60)


# ---------------------------------------------------------------- HTTPClient's own server

def test_embedded_server_keeps_the_header_deadline(monkeypatch):
    """The server ``HTTPClient`` starts has the deadline (shortened here), and the client's own
    pooled connection, closed by it while idle, is replaced on the next call."""
    monkeypatch.setattr(guard, "HEADER_TIMEOUT_S", DEADLINE_S)
    client = HTTPClient(tiny_config("http"))
    try:
        config = client.server.server.config
        assert issubclass(config.http, HeaderDeadline) and config.http.header_timeout_s == DEADLINE_S
        with connect(client.server.port) as s:
            t0 = time.monotonic()
            reply, closed = until_closed(s)
        assert reply == b"" and DEADLINE_S * 0.9 <= closed - t0 < DEADLINE_S + SLACK_S
        params = SamplingParams(max_tokens=3, temperature=0.0)
        first = client.generate([[5, 6, 7]], params)
        time.sleep(2 * DEADLINE_S)  # the server closes the client's idle connection meanwhile
        assert client.generate([[5, 6, 7]], params)[0][0].token_ids == first[0][0].token_ids
    finally:
        client.shutdown()

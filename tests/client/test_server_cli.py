"""``python -m polynya.client.server``: help names the program and every flag, a token is
generated (and printed) for non-loopback addresses, the URL is printed once the server listens."""

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from polynya.client.server import parser, ready_message, server_token
from polynya.distributed import free_port


def test_help_names_program_and_every_flag():
    text = parser().format_help()
    assert text.startswith("usage: python -m polynya.client.server")
    flags = [a for a in parser()._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 10
    for action in flags:
        assert action.help and len(action.help) > 15, action.dest
    assert "Serve polynya's engines" in text and "Example:" in text


@pytest.mark.parametrize(
    "host, given, token, generated",
    [
        ("127.0.0.1", None, None, False),
        ("localhost", None, None, False),
        ("::1", None, None, False),
        ("127.0.0.1", "abc", "abc", False),
        ("0.0.0.0", "abc", "abc", False),
    ],
)
def test_token_given_or_not_needed(host, given, token, generated):
    assert server_token(host, given) == (token, generated)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "node7.cluster"])
def test_token_generated_off_loopback(host):
    a, gen_a = server_token(host, None)
    b, _ = server_token(host, None)
    assert gen_a and a != b and len(a) >= 40
    msg = ready_message(host, 8000, a, True, "/runs/x")
    assert a in msg and "/runs/x" in msg and ":8000" in msg


def test_cli_prints_url_when_ready(tmp_path):
    port = free_port()
    env = dict(os.environ, POLYNYA_API_TOKEN="cli-token", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polynya.client.server",
            "--model",
            "tiny:qwen3",
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--run-dir",
            str(tmp_path / "run"),
            "--config-json",
            '{"train": {"zero_stage": 2}, "sampling": {"num_blocks": 16}}',
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        deadline = time.monotonic() + 240
        while "ready at" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert re.search(rf"ready at http://127\.0\.0\.1:{port} .*run directory: .*run", line), line
        assert "cli-token" not in proc.stdout.readline()  # a given token is never printed
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert httpx.get(url + "/openapi.json").status_code == 401
        ok = httpx.get(url + "/openapi.json", headers={"Authorization": "Bearer cli-token"})
        assert ok.status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)

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


BAD_NUMBERS = [
    ("--port", "0"), ("--port", "65536"), ("--port", "-1"), ("--port", "80.5"),
    ("--max-body-bytes", "0"), ("--max-body-bytes", "-5"), ("--max-body-bytes", "1e3"),
    ("--read-timeout", "0"), ("--read-timeout", "-1"), ("--read-timeout", "nan"),
    ("--read-timeout", "inf"), ("--read-timeout", "soon"),
    ("--min-body-rate", "-1"), ("--min-body-rate", "nan"), ("--min-body-rate", "inf"),
    ("--min-body-rate", "1e999"),
    ("--sampling-gpus", "0"), ("--sampling-gpus", "-2"), ("--sampling-gpus", "1.5"),
    ("--weight-transfer-timeout", "0"), ("--weight-transfer-timeout", "-3"),
    ("--weight-transfer-timeout", "3601"), ("--weight-transfer-timeout", "nan"),
]


@pytest.mark.parametrize("flag, value", BAD_NUMBERS)
def test_bad_numbers_are_argparse_errors(capsys, flag, value):
    """Each was a ValueError traceback once the engines were built (or was taken as given)."""
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["--model", "tiny:qwen3", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: must be" in err and value in err, err


def test_good_numbers_parse():
    a = parser().parse_args(["--model", "m", "--port", "65535", "--max-body-bytes", "1",
                             "--read-timeout", "0.5", "--min-body-rate", "0",
                             "--sampling-gpus", "2", "--weight-transfer-timeout", "3600"])
    assert (a.port, a.max_body_bytes, a.read_timeout, a.min_body_rate, a.sampling_gpus,
            a.weight_transfer_timeout) == (65535, 1, 0.5, 0.0, 2, 3600.0)
    d = parser().parse_args(["--model", "m"])
    assert (d.port, d.max_body_bytes, d.read_timeout, d.min_body_rate, d.sampling_gpus,
            d.weight_transfer_timeout) == (8000, 1 << 30, 30.0, 1024.0, 1, 300.0)


def test_cli_refuses_a_negative_rate_before_loading_anything():
    """``--min-body-rate -1``: exit status 2 with the usage line, no traceback, no model built."""
    proc = subprocess.run(
        [sys.executable, "-m", "polynya.client.server", "--model", "tiny:qwen3",
         "--min-body-rate", "-1"],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "usage: python -m polynya.client.server" in proc.stderr
    assert "error: argument --min-body-rate: must be >= 0 bytes/s" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


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

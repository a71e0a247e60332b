"""Fixtures of the SkyRL adapter tests (run in ``.venvs/skyrl``: ``tests/envs/skyrl``).

``polynya_server`` starts ``python -m polynya.client.server`` (tiny:qwen3, fp32) from the main
``.venv`` as a subprocess, so SkyRL's clients reach it over HTTP exactly as a user's would.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("skyrl", reason="SkyRL tests run in .venvs/skyrl (tests/envs/skyrl/setup.sh)")

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_python() -> str:
    main = ROOT / ".venv" / "bin" / "python"
    return str(main) if main.exists() else sys.executable


@pytest.fixture(scope="module")
def polynya_server():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # stock SkyRL's finish_weight_update sends no checksum: the server must be told to admit that
    cmd = [_server_python(), "-m", "polynya.client.server", "--model", "tiny:qwen3",
           "--dtype", "float32", "--port", str(port), "--no-weight-checksum"]
    (ROOT / ".pytest_reports").mkdir(exist_ok=True)
    log = open(ROOT / ".pytest_reports" / "skyrl_server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"polynya server exited with {proc.returncode}: {cmd} "
                                   "(log: .pytest_reports/skyrl_server.log)")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("polynya server did not answer /health within 180 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

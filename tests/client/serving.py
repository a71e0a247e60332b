"""A polynya server app run by uvicorn in a thread on a free loopback port (the servers' own
config: h11 with the header deadline, ``polynya.client.uvicorn_server``), for tests that need
the server's own knobs (run directory, read timeout, token) or its raw sockets; plus the
snapshot of everything a refused request must leave unchanged."""

from __future__ import annotations

import contextlib
from pathlib import Path

from polynya.client.uvicorn_server import server_config, start_in_thread
from polynya.distributed import free_port


@contextlib.contextmanager
def served(app):
    """Yield the base URL of ``app`` served on ``127.0.0.1``; stop it on exit."""
    port = free_port()
    server, thread = start_in_thread(server_config(app, "127.0.0.1", port, lifespan="off"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def files_under(root) -> dict[str, int]:
    """``{relative path: size}`` of every file below ``root`` (what a request may not change)."""
    root = Path(root)
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def snapshot(local, *dirs) -> dict:
    """Weights checksums (trainer, samplers), served versions, optimizer step, files on disk."""
    sums = local.weight_checksums()
    return {
        "trainer": sums["trainer"],
        "samplers": sums["samplers"],
        "versions": sums["versions"],
        "step": int(local.trainer.engine.global_steps),
        "files": {str(d): files_under(d) for d in dirs},
    }

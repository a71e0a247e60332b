"""What the HTTP server trusts, enforced before a request reaches a route.

- ``TokenGuard`` (ASGI): with a token set, every path but ``/health`` needs
  ``Authorization: Bearer <token>`` (compared in constant time) — the docs and ``/openapi.json``
  included, and any route a module adds later, since the check wraps the whole app;
- ``BodyGuard`` (ASGI): 413 for a body over ``limit`` bytes (declared or streamed), 408 when
  the client sends no body bytes for ``read_timeout_s`` (a body shorter than its
  ``Content-Length`` would otherwise hold the request forever) or sends them slower than
  ``min_rate`` bytes/s on average: the body's deadline is ``read_timeout_s`` plus one second
  per ``min_rate`` bytes received (Apache ``mod_reqtimeout``'s ``MinRate``), so a body
  trickled a byte at a time cannot hold a worker either;
- ``RunDir``: the one directory file routes (``/rl/save``, ``/rl/load``) may touch; a path is
  resolved against it and refused (``PermissionError`` -> 403) when it names ``..``, lies
  outside it, or reaches outside it through a symlink; ``checkpoint_dir`` also refuses what
  ``TrainingEngine.save`` did not write (no manifest, no ``polynya/`` tag directory, non-regular
  files) — the engine then verifies the manifest and unpickles weights-only;
- ``new_token``: the server generates one when it binds a non-loopback address without a token
  (``polynya.distributed.is_loopback`` decides).

The wait for a request's line and headers comes before any ASGI app sees the request: its
bound, ``HEADER_TIMEOUT_S`` by default, is kept by uvicorn's protocol (``uvicorn_server.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import os
import secrets
from pathlib import Path

from ..files import CHECKPOINT_TAG, MANIFEST

PUBLIC_PATHS = ("/health",)
# seconds for a request's line and headers: programs on the trainers' network send them in one
# write; Apache's mod_reqtimeout documents header=10 (default 20-40), nginx waits 60
HEADER_TIMEOUT_S = 10.0


def new_token() -> str:
    """A fresh bearer token (256 random bits, URL-safe)."""
    return secrets.token_urlsafe(32)


async def reply(send, status: int, message: str, headers: list | None = None) -> None:
    """Send a whole JSON ``{"error": message}`` response from ASGI middleware."""
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class TokenGuard:
    """ASGI middleware: 401 unless the bearer token matches (every path but ``/health``)."""

    def __init__(self, app, token: str | None):
        self.app = app
        self.expected = None if token is None else f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and self.expected is not None
            and scope["path"] not in PUBLIC_PATHS
        ):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await reply(
                    send,
                    401,
                    "missing or wrong bearer token: send "
                    "'Authorization: Bearer <token>' (the token the server was "
                    "started with, or printed at start)",
                    [(b"www-authenticate", b"Bearer")],
                )
        return await self.app(scope, receive, send)


class BodyGuard:
    """ASGI middleware: the body read in full (bounded in size, idle time and average rate),
    then replayed."""

    def __init__(self, app, limit: int, read_timeout_s: float, min_rate: float = 1024.0):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be a whole number of bytes >= 0, got {limit!r}")
        if not 0 < read_timeout_s < math.inf:
            raise ValueError(f"read_timeout_s must be > 0 seconds (finite), got {read_timeout_s!r}")
        if not 0 <= min_rate < math.inf:
            raise ValueError(f"min_rate must be >= 0 bytes/s (finite; 0: no rate bound), got "
                             f"{min_rate!r}")
        self.app, self.limit, self.read_timeout_s, self.min_rate = (
            app, limit, read_timeout_s, min_rate)

    def _deadline(self, start: float, received: int) -> float:
        """When the body must be complete, given ``received`` bytes so far."""
        if not self.min_rate:
            return float("inf")
        return start + self.read_timeout_s + received / self.min_rate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await reply(
                send,
                413,
                f"request body of {int(declared)} bytes exceeds the limit of {self.limit}",
            )
        loop = asyncio.get_running_loop()
        body, more, start = bytearray(), True, loop.time()
        last = start  # when the last body bytes came
        while more:
            idle_end, rate_end = last + self.read_timeout_s, self._deadline(start, len(body))
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, min(idle_end, rate_end) - loop.time()))
            except asyncio.TimeoutError:
                if rate_end < idle_end:
                    why = (f"request body too slow: {len(body)} bytes in "
                           f"{loop.time() - start:.1f} s, below the server's minimum of "
                           f"{self.min_rate:g} bytes/s after the first "
                           f"{self.read_timeout_s:g} s")
                else:
                    why = (f"no request body data for {self.read_timeout_s:g} s "
                           f"({len(body)} bytes received; is the body shorter than its "
                           "Content-Length?)")
                return await reply(send, 408, why, [(b"connection", b"close")])
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more, last = msg.get("more_body", False), loop.time()
            if len(body) > self.limit:
                return await reply(
                    send, 413, f"request body exceeds the limit of {self.limit} bytes"
                )
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


class RunDir:
    """The directory the server's file routes are confined to (created if missing)."""

    def __init__(self, root: str | os.PathLike):
        os.makedirs(root, exist_ok=True)
        self.root = Path(os.path.realpath(root))

    def resolve(self, path: object, what: str = "path") -> Path:
        """``path`` (relative to the run directory, or absolute inside it) fully resolved.

        Raises ``ValueError`` for a non-string or empty path or one the OS cannot look up (a
        name too long, ...), ``PermissionError`` for ``..``, a path outside the run directory,
        the run directory itself, or a symlink leading out.
        """
        with _os_errors_as_value_errors(what, path):
            return self._resolve(path, what)

    def _resolve(self, path: object, what: str) -> Path:
        if not isinstance(path, str) or not path or "\x00" in path:
            raise ValueError(
                f"{what} must be a non-empty string without NUL characters, got {path!r}"
            )
        p = Path(path)
        if ".." in p.parts:
            raise PermissionError(
                f"{what} {path!r}: '..' is not allowed; give a path inside the "
                f"server's run directory {self.root}"
            )
        real = Path(os.path.realpath(p if p.is_absolute() else self.root / p))
        if self.root not in real.parents:
            raise PermissionError(
                f"{what} {path!r} resolves to {real}, outside the server's run "
                f"directory {self.root} (start the server with --run-dir to "
                "choose it); give a sub-directory of it"
            )
        self._no_links_out(real, what)
        longest = max(len(part.encode()) for part in real.parts)
        if longest > os.pathconf(self.root, "PC_NAME_MAX"):  # checked before /rl/save writes
            raise ValueError(f"{what} {path[:200]!r}: a name of {longest} bytes is too long for "
                             "the file system")
        return real

    def _no_links_out(self, real: Path, what: str) -> None:
        if not real.is_dir():
            return
        for top, dirs, files in os.walk(real):
            for name in dirs + files:
                entry = Path(top) / name
                if entry.is_symlink() and self.root not in Path(os.path.realpath(entry)).parents:
                    raise PermissionError(
                        f"{what}: {entry} is a symlink leading outside the "
                        f"server's run directory {self.root}"
                    )

    def checkpoint_dir(self, path: object) -> Path:
        """A directory ``TrainingEngine.save`` wrote, inside the run directory, else an error:
        ``FileNotFoundError`` (missing), ``ValueError`` (not a polynya checkpoint),
        ``PermissionError`` (outside the run directory)."""
        real = self.resolve(path, "checkpoint path")
        with _os_errors_as_value_errors("checkpoint path", path):
            return self._checkpoint_dir(real, path)

    def _checkpoint_dir(self, real: Path, path: str) -> Path:
        if not real.exists():
            raise FileNotFoundError(f"no checkpoint at {path!r} (looked at {real})")
        if not real.is_dir():
            raise ValueError(
                f"checkpoint path {path!r} is a file; give the directory that /rl/save wrote"
            )
        tag = real / CHECKPOINT_TAG
        if not (real / MANIFEST).is_file():
            raise ValueError(f"{real} is not a polynya checkpoint (no {MANIFEST} written by "
                             "/rl/save): refusing to load it")
        if not tag.is_dir() or not any(tag.glob("*.pt")):
            raise ValueError(
                f"{real} is not a polynya checkpoint (no {CHECKPOINT_TAG}/*.pt written by /rl/save)"
            )
        for entry in tag.iterdir():
            if not entry.is_file():
                raise ValueError(f"{entry} is not a regular file: refusing to load the checkpoint")
        return real


@contextlib.contextmanager
def _os_errors_as_value_errors(what: str, path: object):
    """An ``OSError`` of a path lookup (name too long, not a directory, ...) as a
    ``ValueError`` naming the path (a 400); ``PermissionError`` / ``FileNotFoundError`` pass."""
    try:
        yield
    except (PermissionError, FileNotFoundError):
        raise
    except OSError as exc:
        raise ValueError(f"{what} {str(path)[:200]!r} cannot be used: {exc.strerror or exc}") from None

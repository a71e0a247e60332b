"""HTTP server (FastAPI + uvicorn, ``polynya[http]``): the client API plus the routes that
vLLM-speaking RL frameworks (TRL server mode, SkyRL's remote engine client) already use.

    python -m polynya.client.server --model tiny:qwen3 --dtype float32 --port 8000 --token SECRET

Binds ``127.0.0.1`` unless told otherwise; with a token every route but ``/health`` needs
``Authorization: Bearer <token>``; bodies over ``max_body_bytes`` get 413. Malformed payloads
get a 4xx with ``{"error": ...}`` and never take the server down.

Client API (``HTTPClient`` speaks it): ``POST /rl/generate`` (JSON), ``/rl/compute_logprobs`` and
``/rl/forward_backward`` (a batch as safetensors bytes, ``polynya.client.codec``), ``/rl/step``,
``/rl/sync_weights``, ``/rl/sleep``, ``/rl/wake``, ``/rl/save``, ``/rl/load``,
``GET /rl/weight_checksums``. Ecosystem routes: ``ecosystem.py``; SkyRL's extra routes:
``routes_skyrl.py``.
"""

import argparse
import hmac
import json
from typing import Any

from .api import EngineError
from .codec import (
    decode_batch,
    encode_stats,
    params_from_json,
    prompts_from_json,
    read_json,
    sample_to_json,
)


def _fastapi():
    try:
        import fastapi  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the HTTP server needs FastAPI and uvicorn: pip install 'polynya[http]'"
        ) from exc


class BodyLimit:
    """ASGI middleware: 413 for bodies over ``limit`` bytes (declared or streamed)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _reply(
                send,
                413,
                f"request body of {int(declared)} bytes exceeds the limit of {self.limit}",
            )
        body, more = bytearray(), True
        while more:  # buffered up to the limit, then replayed to the app
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                return await _reply(
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


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def create_app(
    client, *, api_token: str | None = None, max_body_bytes: int = 1 << 30, tokenizer=None
):
    """A FastAPI app serving ``client`` (a ``LocalClient``; the ecosystem routes use its samplers)."""
    _fastapi()
    from fastapi import Depends, FastAPI, HTTPException, Request, Response
    from fastapi.responses import JSONResponse

    from ..sync import SyncError
    from .ecosystem import add_ecosystem_routes
    from .routes_skyrl import add_skyrl_routes

    def auth(request: Request) -> None:
        if api_token is None or request.url.path == "/health":
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {api_token}".encode()):  # constant time
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    app = FastAPI(title="polynya", dependencies=[Depends(auth)])
    app.state.client = client

    def err(status: int):
        return lambda request, exc: JSONResponse(
            {"error": str(exc), "kind": type(exc).__name__}, status
        )

    app.add_exception_handler(
        HTTPException,
        lambda r, e: JSONResponse({"error": e.detail}, e.status_code, headers=e.headers),
    )
    app.add_exception_handler(ValueError, err(400))
    app.add_exception_handler(SyncError, err(409))
    app.add_exception_handler(NotImplementedError, err(501))
    app.add_exception_handler(EngineError, err(503))
    app.add_exception_handler(RuntimeError, err(409))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/rl/generate")
    async def generate(request: Request) -> dict:
        body = await read_json(request)
        prompts = prompts_from_json(body.get("prompts"))
        raw = body.get("params", {})
        params = (
            [params_from_json(p, f"params[{i}]") for i, p in enumerate(raw)]
            if isinstance(raw, list)
            else params_from_json(raw)
        )
        out = await client.generate_async(prompts, params)
        return {"samples": [[sample_to_json(s) for s in g] for g in out]}

    @app.post("/rl/compute_logprobs")
    async def compute_logprobs(
        request: Request,
        model: str = "policy",
        entropy: bool = False,
        temperature: float | None = None,
    ) -> Response:
        batch = decode_batch(await request.body())
        stats = await client.compute_logprobs_async(
            batch, model=model, entropy=entropy, temperature=temperature
        )
        return Response(encode_stats(stats), media_type="application/octet-stream")

    @app.post("/rl/forward_backward")
    async def forward_backward(request: Request) -> dict:
        return await client.forward_backward_async(decode_batch(await request.body()))

    @app.post("/rl/step")
    async def step() -> dict:
        return await client.step_async()

    @app.post("/rl/sync_weights")
    async def sync_weights() -> dict:
        return await client.sync_weights_async()

    @app.post("/rl/sleep")
    async def sleep(request: Request) -> dict:
        body = await read_json(request)
        await client.sleep_async(body.get("engine", "sampler"), _int(body.get("level", 1), "level"))
        return {"status": "asleep"}

    @app.post("/rl/wake")
    async def wake(request: Request) -> dict:
        body = await read_json(request)
        await client.wake_async(body.get("engine", "sampler"))
        return {"status": "awake"}

    @app.post("/rl/save")
    async def save(request: Request) -> dict:
        await client.save_async(_path(await read_json(request)))
        return {"status": "saved"}

    @app.post("/rl/load")
    async def load(request: Request) -> dict:
        await client.load_async(_path(await read_json(request)))
        return {"status": "loaded"}

    @app.get("/rl/weight_checksums")
    async def weight_checksums() -> dict:
        return await client.weight_checksums_async()

    add_ecosystem_routes(app, client, tokenizer)
    add_skyrl_routes(app, client, tokenizer)
    return BodyLimit(app, max_body_bytes)


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return v


def _path(body: dict) -> str:
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError("'path' must be a non-empty string")
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m polynya.client.server``: build local engines and serve them."""
    import uvicorn

    from .config import RLClientConfig
    from .local import LocalClient

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--token", default=None, help="bearer token (default: none)")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 30)
    ap.add_argument("--sampling-gpus", type=int, default=1)
    ap.add_argument("--no-colocate", action="store_true")
    ap.add_argument("--config-json", default="{}", help="extra RLClientConfig fields as JSON")
    a = ap.parse_args(argv)
    cfg = RLClientConfig(
        a.model,
        dtype=a.dtype,
        comm_protocol="local",
        sampling_gpus=a.sampling_gpus,
        colocate=not a.no_colocate,
        **json.loads(a.config_json),
    )
    client = LocalClient(cfg)
    from ..models import load_tokenizer

    app = create_app(
        client,
        api_token=a.token,
        max_body_bytes=a.max_body_bytes,
        tokenizer=load_tokenizer(cfg.model_name),
    )
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    finally:
        client.shutdown()


if __name__ == "__main__":
    main()

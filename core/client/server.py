"""HTTP server (FastAPI + uvicorn, ``polynya[http]``): the client API plus the routes that
vLLM-speaking RL frameworks (TRL server mode, SkyRL's remote engine client) already use.

    python -m polynya.client.server --model tiny:qwen3 --dtype float32 --port 8000 --run-dir runs/x

Binds ``127.0.0.1`` unless told otherwise; on another address without ``--token`` it generates
one and prints it. With a token every route but ``/health`` needs ``Authorization: Bearer
<token>`` (docs included); bodies over ``max_body_bytes`` get 413, a stalled body 408; file
routes stay inside the run directory (``guard.py``); a request's line and headers have
``--header-timeout`` seconds from the moment a connection opens or its previous response ends
(``uvicorn_server.py``). Malformed payloads get a 4xx with ``{"error": ...}`` and never take the
server down; a wait on something outside the server that runs past its bound (a weight-transfer
group that does not form) gets 504. A generation whose client disconnects (or whose handler is
cancelled) is aborted in the engine at its next step, pages freed (``cancel.py``); the other
requests of the batch are unaffected.

Client API (``HTTPClient`` speaks it): ``POST /rl/generate`` (JSON), ``/rl/compute_logprobs`` and
``/rl/forward_backward`` (a batch as safetensors bytes, ``polynya.client.codec``), ``/rl/step``,
``/rl/sync_weights``, ``/rl/sleep``, ``/rl/wake``, ``/rl/save``, ``/rl/load``,
``GET /rl/weight_checksums``. Ecosystem routes: ``ecosystem.py`` (generation, sleep, pause),
``weight_transfer.py`` (vLLM's weight-transfer routes), SkyRL's extra routes ``routes_skyrl.py``;
each module adds its routes with one ``add_*_routes(app, ...)`` call in ``create_app``.
"""

import argparse
import json
import math
import os

from ..distributed import is_loopback
from .api import EngineError, check_engine
from .codec import (
    decode_batch,
    encode_metrics,
    encode_stats,
    generate_from_json,
    read_json,
    sample_to_json,
)
from .guard import HEADER_TIMEOUT_S, BodyGuard, RunDir, TokenGuard, new_token
from .weight_transfer import INIT_TIMEOUT_S, MAX_INIT_TIMEOUT_S


def _fastapi():
    try:
        import fastapi  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the HTTP server needs FastAPI and uvicorn: pip install 'polynya[http]'"
        ) from exc


def create_app(
    client,
    *,
    api_token: str | None = None,
    max_body_bytes: int = 1 << 30,
    tokenizer=None,
    run_dir: str | os.PathLike = ".",
    read_timeout_s: float = 30.0,
    min_body_rate: float = 1024.0,
    require_weight_checksum: bool = True,
    weight_transfer_timeout_s: float = INIT_TIMEOUT_S,
):
    """The server's ASGI app: ``client`` (a ``LocalClient``) behind the guards of ``guard.py``.

    Args:
        api_token: bearer token every route but ``/health`` needs (None: no token).
        max_body_bytes: larger bodies get 413.
        tokenizer: decodes ``/v1/completions`` text (None: empty text).
        run_dir: the only directory ``/rl/save`` and ``/rl/load`` may touch (created if missing).
        read_timeout_s: 408 when a client sends no body bytes for this long.
        min_body_rate: 408 when a body arrives slower than this many bytes/s on average
            after the first ``read_timeout_s`` (0: no rate bound; the idle bound stays).
        require_weight_checksum: ``/finish_weight_update`` needs the trainer's checksum.
        weight_transfer_timeout_s: how long ``/init_weight_transfer_engine`` waits for the
            trainer's group before it answers 504 (``weight_transfer.py``; at most
            ``MAX_INIT_TIMEOUT_S``).
    """
    _fastapi()
    from fastapi import FastAPI, HTTPException, Request, Response
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    from ..sync import SyncError
    from .cancel import ClientDisconnected, Generations
    from .ecosystem import add_ecosystem_routes
    from .routes_skyrl import add_skyrl_routes
    from .weight_transfer import add_weight_transfer_routes

    app = FastAPI(title="polynya", description=__doc__)
    app.state.client = client
    generations = Generations(client)  # generation aborted when its client disconnects
    run = app.state.run_dir = RunDir(run_dir)

    def err(status: int):
        return lambda request, exc: JSONResponse(
            {"error": str(exc), "kind": type(exc).__name__}, status
        )

    app.add_exception_handler(
        HTTPException,
        lambda r, e: JSONResponse({"error": e.detail}, e.status_code, headers=e.headers),
    )
    for exc_type, status in _STATUS.items():
        app.add_exception_handler(exc_type, err(status))
    app.add_exception_handler(
        RequestValidationError,  # FastAPI's own parameter parsing (e.g. /sleep?level=x)
        lambda r, e: JSONResponse({"error": f"invalid request parameters: {e.errors()}"}, 422),
    )
    app.add_exception_handler(SyncError, err(409))
    app.add_exception_handler(EngineError, err(503))
    app.add_exception_handler(ClientDisconnected, err(499))  # nobody reads it: the client left

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/rl/generate")
    async def generate(request: Request) -> dict:
        prompts, params = generate_from_json(await read_json(request))
        out = await generations(request, prompts, params)
        return {"samples": [[sample_to_json(s) for s in g] for g in out]}

    @app.post("/rl/compute_logprobs")
    async def compute_logprobs(request: Request) -> Response:
        q = request.query_params
        temperature = q.get("temperature")
        stats = await client.compute_logprobs_async(
            decode_batch(await request.body()),
            model=q.get("model", "policy"),
            entropy=_flag(q.get("entropy", "false"), "entropy"),
            temperature=None if temperature is None else _float(temperature, "temperature"),
        )
        return Response(encode_stats(stats), media_type="application/octet-stream")

    @app.post("/rl/forward_backward")
    async def forward_backward(request: Request) -> dict:
        batch = decode_batch(await request.body())
        return encode_metrics(await client.forward_backward_async(batch))

    @app.post("/rl/step")
    async def step() -> dict:
        return encode_metrics(await client.step_async())  # a skipped step's grad_norm is inf

    @app.post("/rl/sync_weights")
    async def sync_weights() -> dict:
        return await client.sync_weights_async()

    @app.post("/rl/sleep")
    async def sleep(request: Request) -> dict:
        body = await read_json(request)  # the level is checked by the hand-over (1 or 2)
        await client.sleep_async(check_engine(body.get("engine", "sampler")), body.get("level", 1))
        return {"status": "asleep"}

    @app.post("/rl/wake")
    async def wake(request: Request) -> dict:
        body = await read_json(request)
        await client.wake_async(check_engine(body.get("engine", "sampler")))
        return {"status": "awake"}

    @app.post("/rl/save")
    async def save(request: Request) -> dict:
        path = run.resolve((await read_json(request)).get("path"))
        if path.exists() and not path.is_dir():
            raise ValueError(f"{path} is a file: /rl/save writes a checkpoint directory")
        await client.save_async(str(path))
        return {"status": "saved", "path": str(path)}

    @app.post("/rl/load")
    async def load(request: Request) -> dict:
        path = run.checkpoint_dir((await read_json(request)).get("path"))
        try:
            await client.load_async(str(path))
        except (ValueError, SyncError, EngineError):
            raise
        except Exception as exc:  # a truncated / foreign file inside a checkpoint directory
            raise ValueError(
                f"the checkpoint at {path} could not be loaded: {type(exc).__name__}: {exc}"
            ) from exc
        return {"status": "loaded", "path": str(path)}

    @app.get("/rl/weight_checksums")
    async def weight_checksums() -> dict:
        return await client.weight_checksums_async()

    add_ecosystem_routes(app, client, tokenizer, generations)
    add_skyrl_routes(app, client, tokenizer)
    add_weight_transfer_routes(app, client, require_checksum=require_weight_checksum,
                               init_timeout_s=weight_transfer_timeout_s)
    return TokenGuard(BodyGuard(app, max_body_bytes, read_timeout_s, min_body_rate), api_token)


# user mistakes -> 4xx; a failure of the server itself -> 500 with the same JSON shape
_STATUS = {
    ValueError: 400,
    PermissionError: 403,
    FileNotFoundError: 404,
    NotImplementedError: 501,
    RuntimeError: 409,
    TimeoutError: 504,  # waited for something outside the server past its bound
    Exception: 500,
}


def _flag(v: str, name: str) -> bool:
    if v.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"{name} must be true or false, got {v!r}")
    return v.lower() in ("true", "1")


def _float(v: str, name: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {v!r}") from None


def _number(kind: type, ok, bound: str):
    """An argparse ``type``: ``kind`` (int or float) within ``ok``, else an argparse error that
    names the option and ``bound`` (never a traceback from deep inside the server)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m polynya.client.server``."""
    ap = argparse.ArgumentParser(
        prog="python -m polynya.client.server",
        description="Serve polynya's engines (training, log-prob, native sampler) over HTTP: the "
        "client API (/rl/*, what comm_protocol='http' speaks) and the vLLM-style routes TRL's "
        "server mode and SkyRL's remote engine client use. Binds 127.0.0.1 unless --host says "
        "otherwise; on any other address a bearer token is required and generated when not given.",
        epilog="Example: python -m polynya.client.server --model tiny:qwen3 --dtype float32 "
        "--port 8000 --run-dir runs/demo   (then: curl localhost:8000/health)",
    )
    ap.add_argument(
        "--model",
        required=True,
        help="HF model id, local path, or tiny:<family> (random tiny model for tests)",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="engine dtype: bfloat16, float16 or float32 (default: %(default)s)",
    )
    ap.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; anything but loopback requires a token (default: %(default)s)",
    )
    ap.add_argument(
        "--port",
        type=_number(int, lambda v: 0 < v < 65536, "from 1 to 65535"),
        default=8000,
        help="TCP port to listen on (default: %(default)s)",
    )
    ap.add_argument(
        "--token",
        default=None,
        help="bearer token for every route but /health (default: $POLYNYA_API_TOKEN, "
        "which keeps it out of the process list; generated and printed when binding "
        "a non-loopback address without one)",
    )
    ap.add_argument(
        "--run-dir",
        default=".",
        help="the only directory /rl/save and /rl/load may use; their paths are "
        "relative to it (created if missing; default: the current directory)",
    )
    ap.add_argument(
        "--max-body-bytes",
        type=_number(int, lambda v: v > 0, "> 0 bytes"),
        default=1 << 30,
        help="larger request bodies are refused with 413 (default: %(default)s)",
    )
    ap.add_argument(
        "--read-timeout",
        type=_number(float, lambda v: 0 < v < math.inf, "> 0 seconds (finite)"),
        default=30.0,
        help="seconds without request-body bytes before a request gets 408 (default: %(default)s)",
    )
    ap.add_argument(
        "--min-body-rate",
        type=_number(float, lambda v: 0 <= v < math.inf, ">= 0 bytes/s (finite; 0: no rate bound)"),
        default=1024.0,
        help="request bodies slower than this many bytes/s on average after the first "
        "--read-timeout seconds get 408, so a body trickled byte by byte cannot hold a worker "
        "(0: no rate bound; default: %(default)s)",
    )
    ap.add_argument(
        "--header-timeout",
        type=_number(float, lambda v: 0 < v < math.inf, "> 0 seconds (finite)"),
        default=HEADER_TIMEOUT_S,
        help="seconds a client has for a request's line and headers, from the moment its "
        "connection opens or its previous response ends; then 408 (part of a request came) "
        "or the connection is closed (nothing came), so a client sending headers byte by byte "
        "or not at all cannot hold a connection (default: %(default)s)",
    )
    ap.add_argument(
        "--no-weight-checksum",
        action="store_true",
        help="let /finish_weight_update apply weights without the trainer's checksum "
        "(for clients that cannot send one; names, shapes, sizes and NaN are still "
        "checked)",
    )
    ap.add_argument(
        "--weight-transfer-timeout",
        type=_number(float, lambda v: 0 < v <= MAX_INIT_TIMEOUT_S,
                     f"> 0 and at most {MAX_INIT_TIMEOUT_S:g} seconds"),
        default=INIT_TIMEOUT_S,
        help="seconds /init_weight_transfer_engine waits for the trainer's group to accept a "
        "connection and form before it answers 504 naming the address; one init at a time, on "
        "a thread of its own (default: %(default)s; at most "
        f"{MAX_INIT_TIMEOUT_S:g})",
    )
    ap.add_argument(
        "--sampling-gpus",
        type=_number(int, lambda v: v > 0, ">= 1"),
        default=1,
        help="sampler replicas (default: %(default)s)",
    )
    ap.add_argument(
        "--no-colocate",
        action="store_true",
        help="put trainer and samplers on separate GPUs (broadcast weight sync)",
    )
    ap.add_argument(
        "--config-json",
        default="{}",
        help='extra RLClientConfig fields as a JSON object, e.g. \'{"train": {"zero_stage": 3}}\'',
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    """``python -m polynya.client.server``: build local engines and serve them."""
    import uvicorn

    from ..models import load_tokenizer
    from .config import RLClientConfig
    from .local import LocalClient
    from .uvicorn_server import server_config

    ap = parser()
    a = ap.parse_args(argv)
    try:
        extra = json.loads(a.config_json)
    except json.JSONDecodeError as exc:
        ap.error(f"--config-json is not valid JSON: {exc}")
    token, generated = server_token(a.host, a.token or os.environ.get("POLYNYA_API_TOKEN"))
    cfg = RLClientConfig(
        a.model,
        dtype=a.dtype,
        comm_protocol="local",
        sampling_gpus=a.sampling_gpus,
        colocate=not a.no_colocate,
        **extra,
    )
    client = LocalClient(cfg)
    app = create_app(
        client,
        api_token=token,
        max_body_bytes=a.max_body_bytes,
        tokenizer=load_tokenizer(cfg.model_name),
        run_dir=a.run_dir,
        read_timeout_s=a.read_timeout,
        min_body_rate=a.min_body_rate,
        require_weight_checksum=not a.no_weight_checksum,
        weight_transfer_timeout_s=a.weight_transfer_timeout,
    )
    server = uvicorn.Server(server_config(app, a.host, a.port, header_timeout_s=a.header_timeout))
    startup = server.startup

    async def announce(sockets=None):  # print once uvicorn is listening
        await startup(sockets)
        if server.started:
            print(ready_message(a.host, a.port, token, generated, app_run_dir(app)), flush=True)

    server.startup = announce
    try:
        server.run()
    finally:
        client.shutdown()


def server_token(host: str, given: str | None) -> tuple[str | None, bool]:
    """``(token, generated)``: the given token, else a fresh one when ``host`` is not loopback."""
    if given:
        return given, False
    if not is_loopback(host):
        return new_token(), True
    return None, False


def app_run_dir(app) -> str:
    """The run directory of an app made by ``create_app``."""
    while not hasattr(getattr(app, "state", None), "run_dir"):
        app = app.app
    return str(app.state.run_dir.root)


def ready_message(host: str, port: int, token: str | None, generated: bool, run_dir: str) -> str:
    """What the server prints when it is ready: URL, run directory, token status."""
    shown = f"[{host}]" if ":" in host else host
    lines = [f"polynya server ready at http://{shown}:{port}  (run directory: {run_dir})"]
    if generated:
        lines.append(f"generated API token (send 'Authorization: Bearer <token>'): {token}")
    elif token is None:
        lines.append("no API token: only processes on this host can reach the server")
    else:
        lines.append("API token required (the one given)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""``HTTPClient``: the client API against a polynya server (``comm_protocol="http"``).

With ``server_url`` it talks to that server; without, it starts one in this process (local
engines behind uvicorn on ``127.0.0.1``, a free port, the config's body limit and run directory,
the config's token or a random one, the server's default body and header deadlines) and stops it
on ``shutdown``. Sync calls use ``httpx.Client``, async ones ``httpx.AsyncClient``; both share
one request description per call, so they behave the same. Errors map back to Python: 4xx →
``ValueError`` (401 / 403 → ``PermissionError``, 404 → ``FileNotFoundError``, 409 →
``RuntimeError``, 501 → ``NotImplementedError``), 5xx and network failures or timeouts →
``EngineError``; polynya's own subclasses (``CheckpointError``, ``SyncError``) come back as
themselves. An error message is the engine's, after ``"<route>: HTTP <status>: "``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from ..files import CheckpointError
from ..sync import SyncError
from ..types import (RolloutBatch, Sample, SamplingParams, TokenSeq, TokenStats, as_token_array,
                     params_per_prompt)
from .api import ClientLifecycle, EngineError, check_engine, check_logprob_model
from .codec import decode_metrics, decode_stats, encode_batch, params_to_json, sample_from_json
from .config import RLClientConfig


def _httpx():
    try:
        import httpx
    except ImportError as exc:
        raise ImportError("comm_protocol='http' needs httpx: pip install 'polynya[http]'") from exc
    return httpx


def _metrics(resp) -> dict:
    return decode_metrics(resp.json())


@dataclasses.dataclass
class _Req:
    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    params: dict | None = None
    decode: Any = None  # response -> value


# polynya's own errors the server names in "kind": raised as themselves where the status's class
# is one of their bases (a CheckpointError is a 400, a SyncError a 409), as the engine raised them
_KINDS = {cls.__name__: cls for cls in (SyncError, CheckpointError)}


def _error(status: int, kind: str | None, text: str) -> Exception:
    """The exception of an error answer (module docstring)."""
    if status in (401, 403):
        base = PermissionError
    elif status == 404:
        base = FileNotFoundError
    elif status == 409:
        base = RuntimeError
    elif status == 501:
        base = NotImplementedError
    elif status < 500:
        base = ValueError
    else:
        base = EngineError
    cls = _KINDS.get(kind)
    return cls(text) if cls is not None and issubclass(cls, base) else base(text)


class _EmbeddedServer:
    """uvicorn in a daemon thread, serving local engines."""

    def __init__(self, config: RLClientConfig):
        from ..distributed import free_port
        from ..models import load_tokenizer
        from .guard import HEADER_TIMEOUT_S, new_token
        from .local import LocalClient
        from .server import create_app
        from .uvicorn_server import server_config, start_in_thread

        self.client = LocalClient(config.replace(comm_protocol="local"))
        self.token = config.api_token or new_token()  # other local users cannot drive it
        try:
            app = create_app(
                self.client,
                api_token=self.token,
                max_body_bytes=config.max_body_bytes,
                tokenizer=load_tokenizer(config.model_name),
                run_dir=config.run_dir or os.getcwd(),
            )
            self.port = free_port()
            self.server, self.thread = start_in_thread(
                server_config(app, "127.0.0.1", self.port, header_timeout_s=HEADER_TIMEOUT_S,
                              lifespan="off"))
        except BaseException:  # the engines built above would outlive a server that never came up
            self.client.shutdown()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.client.shutdown()


class HTTPClient(ClientLifecycle):
    """Client over HTTP (module docstring)."""

    def __init__(self, config: RLClientConfig):
        httpx = self.httpx = _httpx()
        self.config = config
        self.server = None if config.server_url else _EmbeddedServer(config)
        self.url = (config.server_url or self.server.url).rstrip("/")
        token = config.api_token if self.server is None else self.server.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = httpx.Timeout(config.timeout_s, connect=min(30.0, config.timeout_s))
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self._ahttp_args = dict(base_url=self.url, headers=headers, timeout=timeout)
        self._closed = False

    # ------------------------------------------------------------------ transport
    def _result(self, req: _Req, resp):
        if resp.status_code >= 400:
            try:
                body = resp.json()
                msg, kind = body.get("error", resp.text), body.get("kind")
            except ValueError:
                msg, kind = resp.text, None
            raise _error(resp.status_code, kind, f"{req.path}: HTTP {resp.status_code}: {msg}")
        return req.decode(resp) if req.decode else resp.json()

    def _send(self, req: _Req):
        if self._closed:
            raise RuntimeError("the client is shut down")
        try:
            resp = self._http.request(
                req.method, req.path, json=req.json, content=req.content, params=req.params
            )
        except self.httpx.HTTPError as exc:
            raise EngineError(f"{req.path}: {type(exc).__name__}: {exc}") from exc
        return self._result(req, resp)

    async def _asend(self, req: _Req):
        if self._closed:
            raise RuntimeError("the client is shut down")
        try:
            async with self.httpx.AsyncClient(**self._ahttp_args) as http:
                resp = await http.request(
                    req.method, req.path, json=req.json, content=req.content, params=req.params
                )
        except self.httpx.HTTPError as exc:
            raise EngineError(f"{req.path}: {type(exc).__name__}: {exc}") from exc
        return self._result(req, resp)

    # ------------------------------------------------------------------ requests
    @staticmethod
    def _generate_req(prompts, params) -> _Req:
        plist = params_per_prompt(prompts, params)  # ValueError here, before any request
        body = {
            "prompts": [as_token_array(p, f"prompts[{i}]").tolist() for i, p in enumerate(prompts)],
            "params": (params_to_json(params) if isinstance(params, SamplingParams)
                       else [params_to_json(p) for p in plist]),
        }
        decode = lambda r: [[sample_from_json(s) for s in g] for g in r.json()["samples"]]  # noqa: E731
        return _Req("POST", "/rl/generate", json=body, decode=decode)

    @staticmethod
    def _logprobs_req(batch, model, entropy, temperature) -> _Req:
        check_logprob_model(model)
        params = {"model": model, "entropy": str(bool(entropy)).lower()}
        if temperature is not None:
            params["temperature"] = temperature
        return _Req(
            "POST",
            "/rl/compute_logprobs",
            content=encode_batch(batch),
            params=params,
            decode=lambda r: decode_stats(r.content),
        )

    # ------------------------------------------------------------------ sync API
    def generate(
        self, prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[Sample]]:
        return self._send(self._generate_req(prompts, params))

    def compute_logprobs(
        self,
        batch: RolloutBatch,
        *,
        model: str = "policy",
        entropy: bool = False,
        temperature: float | None = None,
    ) -> TokenStats:
        return self._send(self._logprobs_req(batch, model, entropy, temperature))

    def forward_backward(self, batch: RolloutBatch) -> dict[str, float]:
        return self._send(_Req("POST", "/rl/forward_backward", content=encode_batch(batch),
                               decode=_metrics))

    def step(self) -> dict[str, float]:
        return self._send(_Req("POST", "/rl/step", decode=_metrics))

    def sync_weights(self) -> dict[str, Any]:
        return self._send(_Req("POST", "/rl/sync_weights"))

    def sleep(self, engine: str = "sampler", level: int = 1) -> None:
        self._send(_Req("POST", "/rl/sleep", json={"engine": check_engine(engine), "level": level}))

    def wake(self, engine: str = "sampler") -> None:
        self._send(_Req("POST", "/rl/wake", json={"engine": check_engine(engine)}))

    def _path(self, path: str) -> str:
        """A remote server resolves paths in its run directory; the embedded one shares this
        process's working directory, so relative paths mean what they mean to the caller."""
        return os.path.abspath(path) if self.server is not None and isinstance(path, str) else path

    def save(self, path: str) -> None:
        self._send(_Req("POST", "/rl/save", json={"path": self._path(path)}))

    def load(self, path: str) -> None:
        self._send(_Req("POST", "/rl/load", json={"path": self._path(path)}))

    def weight_checksums(self) -> dict[str, Any]:
        return self._send(_Req("GET", "/rl/weight_checksums"))

    # ------------------------------------------------------------------ async API
    async def generate_async(self, prompts, params) -> list[list[Sample]]:
        return await self._asend(self._generate_req(prompts, params))

    async def compute_logprobs_async(
        self, batch, *, model="policy", entropy=False, temperature=None
    ):
        return await self._asend(self._logprobs_req(batch, model, entropy, temperature))

    async def forward_backward_async(self, batch) -> dict[str, float]:
        return await self._asend(_Req("POST", "/rl/forward_backward", content=encode_batch(batch),
                                      decode=_metrics))

    async def step_async(self) -> dict[str, float]:
        return await self._asend(_Req("POST", "/rl/step", decode=_metrics))

    async def sync_weights_async(self) -> dict[str, Any]:
        return await self._asend(_Req("POST", "/rl/sync_weights"))

    async def sleep_async(self, engine: str = "sampler", level: int = 1) -> None:
        await self._asend(
            _Req("POST", "/rl/sleep", json={"engine": check_engine(engine), "level": level})
        )

    async def wake_async(self, engine: str = "sampler") -> None:
        await self._asend(_Req("POST", "/rl/wake", json={"engine": check_engine(engine)}))

    async def save_async(self, path: str) -> None:
        await self._asend(_Req("POST", "/rl/save", json={"path": self._path(path)}))

    async def load_async(self, path: str) -> None:
        await self._asend(_Req("POST", "/rl/load", json={"path": self._path(path)}))

    async def weight_checksums_async(self) -> dict[str, Any]:
        return await self._asend(_Req("GET", "/rl/weight_checksums"))

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._http.close()
        if self.server is not None:
            self.server.stop()

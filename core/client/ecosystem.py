"""vLLM-compatible routes on the polynya server, so TRL's server mode and SkyRL's remote engine
client can drive the native sampler unchanged (payloads as those clients send them):

- ``/v1/models``, ``/server_info``, ``POST /v1/completions``, ``POST /v1/chat/completions``:
  ``openai_compat.py`` (vLLM's OpenAI-compatible answers, as TRL's ``VLLMClient`` reads them);
- ``POST /inference/v1/generate`` — ``{"token_ids": [...], "sampling_params": {...}}``;
- weight transfer (vLLM's RLHF router): ``/init_weight_transfer_engine``
  ``{"init_info": {"master_address", "master_port", "rank_offset", "world_size"}}`` joins a
  broadcast group in which the trainer is rank 0; ``/start_weight_update``; ``/update_weights``
  ``{"update_info": {"names", "dtype_names", "shapes", "packed"}}`` receives one broadcast (packed:
  one flat buffer) or one per tensor, into staging; ``/finish_weight_update`` (optional
  ``"checksum"`` / ``"version"``, or SkyRL's ``"weight_version"``, an int or a string of one)
  verifies and applies the staged weights in one go;
- ``/sleep`` (``?level=``), ``/wake_up``, ``/reset_prefix_cache``, ``/pause`` (``?mode=keep|wait``,
  ``&clear_cache=``; ``polynya.client.gate``), ``/resume``,
  ``GET /get_world_size`` (1: a server joins a weight-transfer group as one rank).
"""

import asyncio
import time
import uuid

import torch

from ..checksum import combine_signatures, tensor_signature
from ..sync import SyncError, SyncGroup
from ..sync.manifest import dtype_from_name
from ..types import SamplingParams
from .gate import GenerationGate
from .openai_compat import add_openai_routes
from .routes_skyrl import openai_error

_PARAM_KEYS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "stop_token_ids",
    "seed",
)


def _params(d: dict, want_logprobs: bool) -> SamplingParams:
    kw = {k: d[k] for k in _PARAM_KEYS if d.get(k) is not None}
    if d.get("ignore_eos"):
        kw["stop_token_ids"] = kw.get("stop_token_ids", [])
    return SamplingParams(**kw, logprobs=want_logprobs)


def _prompt_lists(prompt) -> list[list[int]]:
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return [prompt]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(isinstance(x, int) for x in p) for p in prompt)
    ):
        return prompt
    raise ValueError("prompt must be token ids: a list of ints or a list of lists of ints")


class WeightTransfer:
    """Receiver state of the vLLM-style weight-transfer routes."""

    def __init__(self, samplers):
        self.samplers = samplers
        self.groups: list[SyncGroup] = []
        self.staged: dict[str, torch.Tensor] | None = None

    def init(self, info: dict) -> None:
        try:
            host, port = str(info["master_address"]), int(info["master_port"])
            offset, world = int(info.get("rank_offset", 1)), int(info["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"init_info needs master_address, master_port, world_size: {exc}"
            ) from None
        device = self.samplers[0].device
        self.groups = [
            SyncGroup(host, port, rank=offset + i, world_size=world, device=device)
            for i in range(len(self.samplers))[:1]
        ]

    def update(self, info: dict) -> None:
        if self.staged is None:
            raise RuntimeError("call /start_weight_update before /update_weights")
        if not self.groups:
            raise RuntimeError("call /init_weight_transfer_engine first")
        try:
            names, shapes = list(info["names"]), [tuple(int(x) for x in s) for s in info["shapes"]]
            dtypes = [dtype_from_name(str(d)) for d in info["dtype_names"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"update_info needs names, dtype_names, shapes: {exc}") from None
        if not (len(names) == len(shapes) == len(dtypes)):
            raise ValueError("update_info: names, dtype_names and shapes differ in length")
        group = self.groups[0]
        if info.get("packed"):
            if len(set(dtypes)) != 1:
                raise ValueError("packed update_info needs one dtype")
            sizes = [int(torch.Size(s).numel()) for s in shapes]
            buf = torch.empty(sum(sizes), dtype=dtypes[0], device=group.device)
            group.broadcast(buf, 0).wait()
            for n, s, piece in zip(names, shapes, buf.split(sizes)):
                self.staged[n] = piece.view(s)
        else:
            for n, s, d in zip(names, shapes, dtypes):
                buf = torch.empty(s, dtype=d, device=group.device)
                group.broadcast(buf, 0).wait()
                self.staged[n] = buf

    def finish(self, body: dict) -> int:
        if self.staged is None:
            raise RuntimeError("no weight update in progress")
        version = _explicit_version(body)  # checked before the staged weights are consumed
        staged, self.staged = self.staged, None
        want = body.get("checksum")
        if want is not None:
            got = combine_signatures(tensor_signature(n, t) for n, t in staged.items())
            if got != want:
                raise SyncError(f"checksum mismatch: staged weights hash to {got}, expected {want}")
        out = 0
        for s in self.samplers:
            v = s.stats()["weight_version"] + 1 if version is None else int(version)
            if v <= s.stats()["weight_version"]:
                raise SyncError(f"stale version {v}")
            out = s.load_weights(staged, version=v)
        return out


def _explicit_version(body: dict) -> int | None:
    """``version`` (polynya) or ``weight_version`` (SkyRL's ``finish_weight_update`` sends a
    string) as an int; None when neither is given."""
    raw = body.get("version", body.get("weight_version"))
    if raw is None:
        return None
    try:
        if isinstance(raw, bool) or isinstance(raw, float):
            raise ValueError
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(
            f"weight version must be an integer (or a string of one), got {raw!r}"
        ) from None


def add_ecosystem_routes(app, client, tokenizer) -> None:
    from fastapi import Request

    from .codec import read_json

    samplers = list(getattr(client, "samplers", []))
    transfer = WeightTransfer(samplers)
    gate = GenerationGate()  # pause / resume of every generation route

    async def gen(prompts, params):
        return await gate.run(lambda: client.generate_async(prompts, params))

    add_openai_routes(app, client, tokenizer, gen)  # /v1/models, /server_info, /v1/(chat/)completions

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> dict:
        body = await read_json(request)
        prompts = _prompt_lists(body.get("token_ids"))
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ValueError("sampling_params must be an object")
        want_lp = sp.get("logprobs") is not None
        out = await gen(prompts, _params(sp, want_lp))
        choices = [
            {
                "index": i,
                "token_ids": s.token_ids,
                "finish_reason": s.finish_reason,
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{t}", "logprob": lp}
                        for t, lp in zip(s.token_ids, s.logprobs)
                    ]
                }
                if want_lp
                else None,
            }
            for i, s in enumerate(x for g in out for x in g)
        ]
        n_prompt = sum(len(p) for p in prompts)
        return {
            "request_id": body.get("request_id") or uuid.uuid4().hex,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": sum(len(c["token_ids"]) for c in choices),
            },
        }

    @app.post("/init_weight_transfer_engine")
    async def init_transfer(request: Request) -> dict:
        info = (await read_json(request)).get("init_info")
        if not isinstance(info, dict):
            raise ValueError("missing 'init_info' object in the request body")
        await asyncio.to_thread(transfer.init, info)
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_update(request: Request) -> dict:
        await read_json(request)
        transfer.staged = {}
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict:
        info = (await read_json(request)).get("update_info")
        if not isinstance(info, dict):
            raise ValueError("missing 'update_info' object in the request body")
        await asyncio.to_thread(transfer.update, info)
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_update(request: Request) -> dict:
        body = await read_json(request)
        version = await asyncio.to_thread(transfer.finish, body)
        return {"message": "Weight update finished", "version": version}

    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict:
        await client.sleep_async("sampler", level)
        return {"status": "sleeping"}

    @app.post("/wake_up")
    async def wake_up() -> dict:
        await client.wake_async("sampler")
        return {"status": "awake"}

    def reset_prefix_caches() -> None:
        for s in samplers:
            bm = getattr(getattr(s, "backend", None), "block_manager", None)
            if bm is None:
                raise NotImplementedError("this sampler backend has no prefix cache to reset")
            bm.reset_prefix_cache()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        reset_prefix_caches()
        return {"status": "ok"}

    @app.post("/pause")
    async def pause(mode: str = "keep", clear_cache: bool = False) -> dict:
        in_flight = gate.in_flight
        try:
            await gate.pause(mode)  # modes: polynya.client.gate
        except NotImplementedError as exc:  # abort: say why, in the shape SkyRL's client prints
            return openai_error(501, str(exc))
        if clear_cache:
            reset_prefix_caches()
        return {"status": "paused", "mode": mode, "in_flight_at_pause": in_flight}

    @app.post("/resume")
    async def resume() -> dict:
        gate.resume()
        return {"status": "resumed"}

    @app.get("/get_world_size")
    async def get_world_size() -> dict:
        return {
            "world_size": 1
        }  # one receiving rank per server (rank_offset), whatever its replicas

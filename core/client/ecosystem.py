"""vLLM-compatible routes on the polynya server, so TRL's server mode and SkyRL's remote engine
client can drive the native sampler unchanged (payloads as those clients send them); the
weight-transfer routes are in ``weight_transfer.py``:

- ``/v1/models``, ``/server_info``, ``POST /v1/completions``, ``POST /v1/chat/completions``:
  ``openai_compat.py`` (vLLM's OpenAI-compatible answers, as TRL's ``VLLMClient`` reads them);
- ``POST /inference/v1/generate`` — ``{"token_ids": [...], "sampling_params": {...},
  "request_id": "..."}`` (``sampling_params`` absent or null: the defaults; ``request_id`` a
  string, echoed, absent or null: a fresh one; any other type of either is a 400); ``model``
  (not checked) and ``cache_salt`` (prefix-cache isolation, which changes no token) are
  accepted, ``stream`` only as false; any other top-level key — multimodal ``features``
  included — is a 400 naming it (it would otherwise be ignored);
- ``/sleep`` (``?level=`` 1 or 2), ``/wake_up``, ``/reset_prefix_cache``, ``/pause``
  (``?mode=keep|wait|abort``, ``&clear_cache=``; ``polynya.client.gate``), ``/resume``,
  ``GET /get_world_size`` (1: a server joins a weight-transfer group as one rank).

A generation whose HTTP client disconnects is aborted in the engine (``cancel.py``).
"""

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

from ..types import SamplingParams
from .cancel import Generations
from .gate import GenerationGate
from .openai_compat import (
    NEUTRAL_VALUES,
    SAMPLING_FIELDS,
    add_openai_routes,
    object_field,
    sampling_params,
)
from .routes_skyrl import openai_error

# what /inference/v1/generate's sampling_params may hold: vLLM's fields polynya's sampler
# implements, the neutral values of those it does not (``openai_compat.sampling_params`` checks
# both, as for /v1/completions), and the fields SkyRL's generator sends that change no token
_GENERATE_KEYS = {*SAMPLING_FIELDS, *NEUTRAL_VALUES, "top_k", "stop", "skip_special_tokens"}
_ROUTE_ONLY = {"logprobs", "prompt_logprobs", "include_stop_str_in_output", "output_kind"}
# the request's top level: what SkyRL's RemoteInferenceClient sends that changes no token, or
# what the route reads; "stream" only as false (one JSON answer)
_BODY_KEYS = {"token_ids", "sampling_params", "request_id", "model", "cache_salt", "stream"}


def check_body(body: dict) -> None:
    """``ValueError`` naming a top-level key of ``/inference/v1/generate`` it would ignore."""
    unknown = sorted(set(body) - _BODY_KEYS)
    if unknown:
        raise ValueError(f"/inference/v1/generate: unsupported field(s) {unknown} (multimodal "
                         f"features, side channels); the body takes {sorted(_BODY_KEYS)}")
    if body.get("stream") not in (None, False):
        raise ValueError(f"stream={body['stream']!r} is not supported: the answer is one JSON "
                         "object; send stream=false or leave it out")


def generate_params(sp: dict) -> SamplingParams:
    """``/inference/v1/generate``'s vLLM ``sampling_params`` -> ``SamplingParams``
    (``ValueError`` naming a field it would otherwise ignore). vLLM's rules: ``top_k=0`` is off,
    ``max_tokens`` defaults to 16, stop ids add to the model's EOS unless ``ignore_eos``.
    ``logprobs=k`` returns the sampled token's log-prob (no top-k alternatives; processed: after
    temperature and filters, vLLM's ``processed_logprobs``, as ``/server_info`` reports);
    ``min_tokens`` as vLLM applies it (``SamplingParams.min_tokens``; SkyRL's generator sends 1)."""
    if sp.get("prompt_logprobs") is not None:
        raise ValueError("prompt_logprobs is not served by /inference/v1/generate; ask "
                         "/v1/completions with prompt_logprobs")
    logprobs = sp.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ValueError(f"logprobs must be null or an int >= 0, got {logprobs!r}")
    return sampling_params({k: v for k, v in sp.items() if k not in _ROUTE_ONLY}, _GENERATE_KEYS,
                           logprobs=logprobs is not None)


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


def add_ecosystem_routes(app, client, tokenizer, generations: Generations) -> None:
    """Register the routes above; ``generations`` runs their engine calls (aborted when the
    HTTP client disconnects, ``cancel.py``)."""
    from fastapi import Request

    from .codec import read_json

    samplers = list(getattr(client, "samplers", []))
    gate = GenerationGate()  # pause / resume of every generation route

    async def gen(prompts, params, request=None):
        return await generations(request, prompts, params, gate=gate)

    score = None
    if hasattr(client, "prompt_logprobs_async"):  # prompt_logprobs of /v1/completions
        async def score(seqs, top_k, temperature):
            return await gate.run(lambda: client.prompt_logprobs_async(seqs, top_k=top_k,
                                                                       temperature=temperature))

    add_openai_routes(app, client, tokenizer, gen, score)  # /v1/models, /server_info, /v1/(chat/)completions

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> dict:
        body = await read_json(request)
        check_body(body)
        prompts = _prompt_lists(body.get("token_ids"))
        params = generate_params(object_field(body, "sampling_params"))
        request_id = body.get("request_id")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string (or null for a fresh one), got "
                             f"{type(request_id).__name__} {request_id!r:.100}")
        want_lp = params.logprobs
        out = await gen(prompts, params, request)
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
            "request_id": uuid.uuid4().hex if request_id is None else request_id,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": sum(len(c["token_ids"]) for c in choices),
            },
        }

    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict:
        await client.sleep_async("sampler", level)
        return {"status": "sleeping"}

    @app.post("/wake_up")
    async def wake_up() -> dict:
        await client.wake_async("sampler")
        return {"status": "awake"}

    def reset_prefix_caches() -> None:
        resets = [getattr(getattr(s, "backend", None), "reset_prefix_cache", None) for s in samplers]
        if None in resets:
            raise NotImplementedError("this sampler backend has no prefix cache to reset")
        for reset in resets:
            reset()  # between two engine steps (the native engine books the step in flight first)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        reset_prefix_caches()
        return {"status": "ok"}

    # abort waits for an engine step boundary on threads of its own: the default executor may
    # be full of the very generate calls it has to stop
    abort_pool = ThreadPoolExecutor(max(1, len(samplers)), thread_name_prefix="polynya-abort")

    async def abort_all() -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*[loop.run_in_executor(abort_pool, s.abort) for s in samplers])

    @app.post("/pause")
    async def pause(mode: str = "keep", clear_cache: bool = False) -> dict:
        in_flight = gate.in_flight
        try:
            await gate.pause(mode, abort_all if samplers else None)  # modes: polynya.client.gate
        except NotImplementedError as exc:  # say why, in the shape SkyRL's client prints
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

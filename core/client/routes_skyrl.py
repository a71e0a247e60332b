"""Routes of the polynya HTTP server that SkyRL 0.4's ``RemoteInferenceClient`` (and the paths
of its trainer) call beyond the vLLM-compatible ones in ``ecosystem.py``.

Served:

- ``GET /is_sleeping`` — ``{"is_sleeping": bool}`` (SkyRL's colocated weight sync asks it);
- ``POST /tokenize`` ``{"prompt": str, "add_special_tokens": bool}`` (or ``{"messages": [...]}``
  through the chat template, with ``add_generation_prompt`` / ``chat_template_kwargs``) ->
  ``{"tokens", "count"}``; any other field of vLLM's tokenize requests that would change the
  tokens (``tools``, ``continue_final_message``, ``add_special_tokens=true`` with messages, ...)
  is a 400 naming it,
  ``POST /detokenize`` ``{"tokens": [...]}`` -> ``{"prompt": str}`` (vLLM's schema; needs the
  server to have a tokenizer);
- ``POST /finish_session`` — accepted and ignored: the server keeps no per-session state (it is
  a router's route; SkyRL sends it to the data-plane URL).

(``/v1/chat/completions``, which SkyRL's ``chat_completion`` calls, is ``openai_compat.py``'s.)

Refused with 501 and a message saying what to configure instead (``{"error": {"message": ...}}``,
the OpenAI shape SkyRL's clients print): ``/skyrl/v1/generate`` (routed experts / sample-support
replay), ``/collective_rpc`` (vLLM worker-extension calls), ``/fetch_weights`` (the delta weight
sync backend), LoRA adapter loading, ``/start_draft_weight_update`` (speculative decoding) and
``/v1/chat/completions/render`` (multimodal prompts).
"""
# no ``from __future__ import annotations``: FastAPI must resolve the route signatures
import asyncio

from .openai_compat import chat_prompt

_REFUSALS = {
    "/skyrl/v1/generate": (
        "polynya's sampler returns neither routed experts nor sample-support sets: set "
        "generator.inference_engine.enable_return_routed_experts=false and leave "
        "sample-support replay off"
    ),
    "/fetch_weights": (
        "polynya's server receives weights over the broadcast routes (/init_weight_transfer_engine, "
        "/update_weights, /finish_weight_update); the delta checkpoint backend is not supported: "
        "set generator.inference_engine.weight_sync_backend=nccl"
    ),
    "/skyrl/v1/load_lora_adapter": (
        "LoRA adapters are not supported: polynya trains and serves full weights "
        "(trainer.policy.model.lora.rank=0)"
    ),
    "/v1/load_lora_adapter": "LoRA adapters are not supported (trainer.policy.model.lora.rank=0)",
    "/v1/unload_lora_adapter": "LoRA adapters are not supported (trainer.policy.model.lora.rank=0)",
    "/start_draft_weight_update": (
        "speculative decoding is not supported: polynya's sampler has no drafter model to update"
    ),
    "/v1/chat/completions/render": (
        "prompt rendering for multimodal inputs is not supported: send token ids to "
        "/inference/v1/generate or text messages to /v1/chat/completions"
    ),
}

_RPC_HINTS = {
    "skyrl_sleep_for_weight_sync": (
        "set generator.inference_engine.offload_kv_for_weight_sync=false: polynya applies staged "
        "weights atomically between engine steps, so no allocator sleep is needed around a sync"
    ),
    "skyrl_wake_for_weight_sync": (
        "set generator.inference_engine.offload_kv_for_weight_sync=false (see "
        "skyrl_sleep_for_weight_sync)"
    ),
}


def openai_error(status: int, message: str, kind: str = "NotImplementedError"):
    """An error response in the OpenAI / vLLM shape, whose message SkyRL's clients print."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def _refusal(message: str):
    return openai_error(501, message)


# what /tokenize reads (plus ``model``, not checked), by request kind; vLLM's chat form defaults
# ``add_special_tokens`` to false, the only value the template path gives
_TOKENIZE_KEYS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_TOKENIZE_CHAT_KEYS = {"model", "messages", "add_generation_prompt", "chat_template",
                       "chat_template_kwargs", "add_special_tokens", "return_token_strs"}


def check_tokenize_body(body: dict) -> None:
    """``ValueError`` naming a ``/tokenize`` field the route would otherwise ignore."""
    chat = "messages" in body
    unknown = sorted(set(body) - (_TOKENIZE_CHAT_KEYS if chat else _TOKENIZE_KEYS))
    if unknown:
        raise ValueError(f"/tokenize: unsupported field(s) {unknown}; it takes "
                         f"{sorted(_TOKENIZE_CHAT_KEYS if chat else _TOKENIZE_KEYS)}")
    for key in ("add_special_tokens", "add_generation_prompt", "return_token_strs"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ValueError(f"{key} must be true or false, got {body[key]!r}")
    if body.get("return_token_strs"):
        raise ValueError("/tokenize: return_token_strs=true is not supported (ids only); send false")
    if chat and body.get("add_special_tokens"):
        raise ValueError("/tokenize with messages: add_special_tokens=true is not supported (the "
                         "chat template's tokens are returned as rendered); send false or leave it out")


def _token_ids(value, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ValueError(f"{what} must be a list of non-negative token ids")
    return value


def add_skyrl_routes(app, client, tokenizer) -> None:
    """Register the routes above on ``app`` (after ``add_ecosystem_routes``)."""
    from fastapi import Request

    from .codec import read_json

    def need_tokenizer(route: str):
        if tokenizer is None:
            raise NotImplementedError(f"{route} needs the server to be started with a tokenizer")
        return tokenizer

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": bool(client.sampler_asleep)}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await read_json(request)
        check_tokenize_body(body)
        tok = need_tokenizer("/tokenize")
        if "messages" in body:
            ids = await asyncio.to_thread(chat_prompt, body, tok)  # off the event loop
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ValueError("/tokenize needs 'prompt' (a string) or 'messages'")
            ids = tok(prompt, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        return {"tokens": list(ids), "count": len(ids)}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await read_json(request)
        tok = need_tokenizer("/detokenize")
        ids = _token_ids(body.get("tokens"), "tokens")
        if ids and max(ids) >= len(tok):
            raise ValueError(f"token id {max(ids)} is outside the vocabulary ({len(tok)} ids)")
        return {"prompt": tok.decode(ids)}

    @app.post("/finish_session")
    async def finish_session() -> dict:
        return {"status": "ok"}  # no per-session state to release

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        body = await read_json(request)
        method = body.get("method")
        if not isinstance(method, str):
            raise ValueError(f"/collective_rpc needs a method name (a string), got {method!r}")
        hint = _RPC_HINTS.get(method, "LoRA adapters are not supported (lora.rank=0)"
                              if "lora" in method else
                              "polynya's server runs no vLLM worker extension")
        return _refusal(f"/collective_rpc method {method!r} is not supported: {hint}")

    for path, message in _REFUSALS.items():
        app.add_api_route(path, _refuser(message), methods=["POST"])


def _refuser(message: str):
    async def refuse():
        return _refusal(message)

    return refuse

"""vLLM's OpenAI-compatible text routes on the polynya server, as vLLM answers them, so TRL's
``trl.generation.vllm_client.VLLMClient`` (and any OpenAI-style client) can generate on the
native sampler:

- ``GET /v1/models`` — the served model (``data[0].id``, ``max_model_len``);
- ``GET /server_info`` — ``{"vllm_config": {...}}`` with the fields TRL reads:
  ``model_config.logprobs_mode`` (``processed_logprobs``: the sampler's log-probs are taken after
  temperature and filters) and ``weight_transfer_config`` (``None``: TRL's weight sync speaks
  vLLM's NCCL rendezvous, which this server does not, so TRL refuses ``init_communicator`` with a
  clear message instead of hanging);
- ``POST /v1/completions`` — ``prompt`` as text, a list of texts, token ids or a list of
  token-id lists; ``n`` completions per prompt, prompt-major; ``top_k`` 0 or -1 = off (vLLM's and
  TRL's convention); ``max_tokens`` absent: 16, null: up to the end of the model window (vLLM's
  ``get_max_tokens``); ``logprobs`` 0 = the sampled token's log-prob (as ``tokens`` /
  ``token_logprobs`` / ``top_logprobs``); every choice carries ``prompt_token_ids`` and
  ``token_ids`` (vLLM's ``return_token_ids``, always on); ``return_tokens_as_token_ids`` names
  tokens ``"token_id:<id>"``; the ``model`` field is not checked (the answer names the served one);
  ``prompt_logprobs: k`` (-1: the whole vocabulary) scores each prompt on the sampler's weights
  (``SamplingEngine.prompt_logprobs``, native sampler) and gives every choice vLLM's list:
  ``None`` for the first token, then per token ``{"<id>": {"logprob", "rank", "decoded_token"}}``
  holding the ``k`` most likely tokens (ranks 1..k) plus the prompt's own token at its rank —
  what TRL's ``VLLMClient.get_sequence_logprobs`` reads; log-probs of ``logits / temperature``
  (``processed_logprobs``), so top-k / top-p / min-p filters are refused alongside it;
- ``POST /v1/chat/completions`` — ``messages`` rendered with the tokenizer's chat template
  (``chat_template`` / ``chat_template_kwargs`` honoured), top-level ``prompt_token_ids``,
  per-choice ``message``, ``token_ids`` and ``logprobs.content``; ``max_completion_tokens``, else
  ``max_tokens``, else up to the end of the model window (as vLLM); ``logprobs`` a bool.

On both, a choice's text leaves out the stop token that ended it unless
``include_stop_str_in_output`` (vLLM's detokenizer); ``token_ids`` and log-probs keep it.

Refused with 400 (never silently ignored): ``repetition_penalty`` != 1, presence/frequency
penalties, ``logprobs`` / ``top_logprobs`` > 0 (the native sampler keeps the sampled token's
log-prob only; on chat with or without ``logprobs``), stop strings, ``echo``, streaming,
structured outputs, tools, images, and any other field this module does not know; ``prompt_logprobs`` on chat (served on
``/v1/completions`` only). A client or backend that cannot score (Ray client, vLLM backend)
answers 501.
"""

import asyncio
import inspect
import time
import uuid
from typing import Any

from ..types import SamplingParams

MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs: what one request may ask per prompt token
SAMPLING_FIELDS = ("n", "temperature", "top_p", "min_p", "max_tokens", "min_tokens", "seed",
                   "stop_token_ids")
DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) max_tokens of a completion request that has none
NEUTRAL_VALUES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "echo": False, "stream": False, "ignore_eos": False}
_COMMON = {"model", "top_k", "logprobs", "return_token_ids", "return_tokens_as_token_ids", "user",
           "skip_special_tokens", "include_stop_str_in_output", "stop", "prompt_logprobs",
           "structured_outputs", *SAMPLING_FIELDS, *NEUTRAL_VALUES}
BOOL_FIELDS = ("skip_special_tokens", "include_stop_str_in_output", "ignore_eos", "echo", "stream",
               "return_token_ids", "return_tokens_as_token_ids", "add_generation_prompt")
_UNSERVED = (("stop", (str, list), "a string or a list of strings"),
             ("structured_outputs", dict, "an object"), ("tools", list, "a list"))
_COMPLETION_KEYS = _COMMON | {"prompt"}
_CHAT_KEYS = _COMMON | {"messages", "top_logprobs", "chat_template", "chat_template_kwargs",
                        "add_generation_prompt", "tools", "tool_choice", "max_completion_tokens"}


def object_field(body: dict[str, Any], key: str) -> dict[str, Any]:
    """``body[key]``, an object; absent or null: ``{}`` (the defaults, as vLLM's request models
    read a null); anything else, a falsy ``0`` / ``""`` / ``[]`` / ``false`` included: ``ValueError``."""
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object (or null for the defaults), got "
                         f"{type(value).__name__} {value!r:.100}")
    return value


def sampling_params(body: dict[str, Any], keys: set[str], *, logprobs: bool = True,
                    window: int | None = None) -> SamplingParams:
    """vLLM request fields -> ``SamplingParams`` (``ValueError`` naming what is not supported).
    ``window``: the served model's length, what ``max_tokens`` means when vLLM lets a completion
    run to the end of the window (``max_tokens_of``); None where the route does not know it."""
    unknown = sorted(set(body) - keys)
    if unknown:
        raise ValueError(f"unsupported request field(s) {unknown}; polynya's server takes {sorted(keys)}")
    for k, neutral in NEUTRAL_VALUES.items():
        if k in body and body[k] is not None and body[k] != neutral and k != "ignore_eos":
            raise ValueError(f"{k}={body[k]!r} is not supported by polynya's sampler (only {neutral!r})")
    for k, kinds, what in _UNSERVED:  # null or empty: off; a falsy value of another type: 400
        if body.get(k) is not None and not isinstance(body[k], kinds):
            raise ValueError(f"{k} must be {what} or null, got {type(body[k]).__name__} "
                             f"{body[k]!r:.100}")
        if body.get(k):
            raise ValueError(f"{k!r} is not supported by polynya's sampler")
    for k in BOOL_FIELDS:
        if body.get(k) is not None and not isinstance(body[k], bool):
            raise ValueError(f"{k} must be true or false, got {body[k]!r}")
    kw = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    kw["max_tokens"] = max_tokens_of(body, keys, window)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1: off), got {top_k!r}")
        kw["top_k"] = -1 if top_k == 0 else top_k
    # vLLM's rule: stop_token_ids add to the model's EOS, which ignore_eos turns off
    return SamplingParams(**kw, logprobs=logprobs, stop_at_eos=not body.get("ignore_eos"))


def max_tokens_of(body: dict[str, Any], keys: set[str], window: int | None) -> Any:
    """A request's ``max_tokens`` as vLLM reads it (``get_max_tokens``): chat's
    ``max_completion_tokens``, else ``max_tokens``; absent on a completion request: 16; null, or
    absent on chat: up to the end of the model window — ``window`` as ``max_tokens``, since the
    sampler ends every completion there (``"length"``). ``ValueError`` when that is asked and
    ``window`` is unknown (never a silent 16)."""
    for k in ("max_completion_tokens", "max_tokens"):
        if k in keys and body.get(k) is not None:
            return body[k]
    if "max_tokens" not in body and "max_completion_tokens" not in keys:
        return DEFAULT_MAX_TOKENS  # a completion request without the field
    if not window:
        raise ValueError("max_tokens: send a number; this route does not know the model window "
                         "that vLLM reads a null (or, on chat, an absent) max_tokens as")
    return window


def prompt_logprobs_k(body: dict, params: SamplingParams) -> int | None:
    """``prompt_logprobs`` of a request: None (not asked) or ``k``; ``ValueError`` when it is not
    an int in ``[0, MAX_PROMPT_LOGPROBS]`` (a bound on the answer: ``k`` entries per prompt
    token) or comes with a filter (the scores are of ``logits / temperature``)."""
    k = body.get("prompt_logprobs")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_PROMPT_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be an int in [0, {MAX_PROMPT_LOGPROBS}] (vLLM's default "
                         f"max_logprobs; the whole vocabulary, -1, is not served), got {k!r}")
    if params.top_k > 0 or params.top_p < 1 or (params.min_p or 0) > 0:
        raise ValueError("prompt_logprobs with top_k / top_p / min_p: polynya scores prompts under "
                         "logits / temperature only; drop the filters from this request")
    return k


def prompt_logprobs_json(scores, seq: list[int], as_ids: bool, tokenizer) -> list[dict | None]:
    """vLLM's per-prompt ``prompt_logprobs`` list for one ``PromptLogprobs`` of ``seq``."""
    names: dict[int, str] = {}  # each token decoded once per answer

    def name(t: int) -> str:
        if t not in names:
            names[t] = _token_name(t, as_ids, tokenizer)
        return names[t]

    out: list[dict | None] = [None]
    top_ids, top_lps = scores.top_ids.tolist(), scores.top_logprobs.tolist()
    for pos, (lp, rank, ids, lps) in enumerate(zip(scores.logprobs.tolist(), scores.ranks.tolist(),
                                                   top_ids, top_lps), start=1):
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": name(t)}
                 for r, (t, v) in enumerate(zip(ids, lps), start=1)}
        tok = seq[pos]
        if str(tok) not in entry:
            entry[str(tok)] = {"logprob": lp, "rank": rank, "decoded_token": name(tok)}
        out.append(entry)
    return out


def _chat_logprobs(body: dict) -> bool:
    """Chat's ``logprobs`` (a bool) and ``top_logprobs`` (alternatives per token: only 0 is
    served, whether or not ``logprobs`` is on, as vLLM refuses it without ``logprobs``)."""
    value = body.get("logprobs")
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"logprobs must be true or false on chat (top_logprobs counts the "
                         f"alternatives), got {value!r}")
    _want_logprobs(body.get("top_logprobs"), "top_logprobs")
    return bool(value)


def _want_logprobs(value, name: str) -> bool:
    if value is None or value is False:
        return False
    if value is True or value == 0:
        return True
    raise ValueError(f"{name}={value!r}: polynya's sampler returns the sampled token's log-prob only "
                     f"(use {name}=0)")


def _prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return [prompt]
    if not (isinstance(prompt, list) and prompt):
        raise ValueError("prompt must be text, a list of texts, token ids or a list of token-id lists")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need the server's tokenizer; send token ids")
            p = tokenizer.encode(p, add_special_tokens=True)
        if not (isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p)):
            raise ValueError(f"prompt[{i}] must be text or a non-empty list of token ids")
        out.append(p)
    return out


def _token_name(t: int, as_ids: bool, tokenizer) -> str:
    return f"token_id:{t}" if as_ids or tokenizer is None else tokenizer.decode([t])


def _text(sample, tokenizer, body) -> str:
    """A choice's text, as vLLM's detokenizer writes it: the stop token that ended it is not
    decoded unless ``include_stop_str_in_output`` (its id stays in ``token_ids``)."""
    if tokenizer is None:
        return ""
    ids = sample.token_ids
    if sample.finish_reason == "stop" and ids and not body.get("include_stop_str_in_output"):
        ids = ids[:-1]
    skip = body.get("skip_special_tokens")
    return tokenizer.decode(ids, skip_special_tokens=True if skip is None else skip)


def _usage(prompts, samples) -> dict:
    p, c = sum(map(len, prompts)), sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def stop_reason(sample, params: SamplingParams, tokenizer) -> int | None:
    """vLLM's ``stop_reason`` of a choice: the id of the stop token that ended it, or None when
    it ended at the tokenizer's EOS (unless ``ignore_eos``), at its length, or was aborted
    (vLLM's ``check_stop``: the model's other EOS ids count as stop ids there). Without a
    tokenizer only the request's own ``stop_token_ids`` are reported."""
    if sample.finish_reason != "stop" or not sample.token_ids:
        return None
    tok = sample.token_ids[-1]
    if params.stops_at_eos:
        eos = getattr(tokenizer, "eos_token_id", None)
        if tok == eos or (eos is None and tok not in (params.stop_token_ids or ())):
            return None
    return tok


def completion_response(body: dict, prompts, groups, tokenizer, model: str, want_lp: bool,
                        params: SamplingParams, scores=None) -> dict:
    """vLLM's ``/v1/completions`` answer for ``groups`` (per prompt, its ``n`` samples, drawn
    with ``params``), with ``scores`` (per prompt, its ``PromptLogprobs``) as every choice's
    ``prompt_logprobs``."""
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    choices = []
    for i, (prompt, group) in enumerate(zip(prompts, groups)):
        plp = None if scores is None else prompt_logprobs_json(scores[i], prompt, as_ids, tokenizer)
        for s in group:
            names = [_token_name(t, as_ids, tokenizer) for t in s.token_ids]
            lp = None
            if want_lp:
                lp = {"tokens": names, "token_logprobs": list(s.logprobs),
                      "top_logprobs": [{n: v} for n, v in zip(names, s.logprobs)],
                      "text_offset": None}
            choices.append({"index": len(choices), "text": _text(s, tokenizer, body),
                            "logprobs": lp, "finish_reason": s.finish_reason,
                            "stop_reason": stop_reason(s, params, tokenizer),
                            "prompt_logprobs": plp, "prompt_token_ids": list(prompt),
                            "token_ids": list(s.token_ids)})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": _usage(prompts, [s for g in groups for s in g])}


def chat_prompt(body: dict, tokenizer) -> list[int]:
    """The chat ``messages`` rendered and tokenized with the tokenizer's (or the given) template."""
    if tokenizer is None:
        raise ValueError("chat needs the server's tokenizer")
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be text (images and content parts are not supported)")
    if body.get("chat_template") is not None:  # vLLM refuses it too by default (CVE-2025-61620)
        raise ValueError("a request's chat_template is refused: a template runs on the server, with no "
                         "bound on its memory or time. Serve a model directory whose tokenizer has the "
                         "template you need")
    kwargs = object_field(body, "chat_template_kwargs")
    reserved = sorted(set(kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
    if reserved:  # the template's variables only; these are the call's own arguments
        raise ValueError(f"chat_template_kwargs may not set {reserved}: they are arguments of the "
                         "template call itself (use the request's own fields, e.g. "
                         "add_generation_prompt)")
    out = tokenizer.apply_chat_template(messages, tokenize=True,
                                        add_generation_prompt=body.get("add_generation_prompt", True),
                                        **kwargs)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


def chat_response(body: dict, prompt, group, tokenizer, model: str, want_lp: bool,
                  params: SamplingParams) -> dict:
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    choices = []
    for s in group:
        lp = None
        if want_lp:
            lp = {"content": [{"token": _token_name(t, as_ids, tokenizer), "logprob": v, "bytes": None,
                               "top_logprobs": []} for t, v in zip(s.token_ids, s.logprobs)]}
        choices.append({"index": len(choices),
                        "message": {"role": "assistant", "content": _text(s, tokenizer, body)},
                        "logprobs": lp, "finish_reason": s.finish_reason,
                        "stop_reason": stop_reason(s, params, tokenizer),
                        "token_ids": list(s.token_ids)})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "prompt_token_ids": list(prompt), "choices": choices,
            "usage": _usage([prompt], group)}


def add_openai_routes(app, client, tokenizer, generate, score=None) -> None:
    """Register the routes on ``app``; ``generate(prompts, params, request)`` is the server's
    (pausable) generation coroutine, aborted when ``request``'s client disconnects, ``score(sequences, top_k, temperature)`` its prompt-scoring one (None:
    ``prompt_logprobs`` answers 501)."""
    from fastapi import Request

    from .codec import read_json

    config = getattr(client, "config", None)
    model = getattr(config, "model_name", "polynya")
    samplers = list(getattr(client, "samplers", []))
    max_len = int(getattr(samplers[0], "max_model_len", 0) or 0) if samplers else 0

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                            "owned_by": "polynya", "root": model, "max_model_len": max_len}]}

    @app.get("/server_info")
    async def server_info(config_format: str = "json") -> dict:
        return {"vllm_config": {
            "model_config": {"model": model, "max_model_len": max_len, "logprobs_mode": "processed_logprobs"},
            "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
            "weight_transfer_config": None}}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await read_json(request)
        params = sampling_params(body, _COMPLETION_KEYS, window=max_len)
        want_lp = _want_logprobs(body.get("logprobs"), "logprobs")
        prompts = _prompts(body.get("prompt"), tokenizer)
        k = prompt_logprobs_k(body, params)
        if k is not None and score is None:
            raise NotImplementedError("prompt_logprobs: this server's client cannot score prompts "
                                      "(served with comm_protocol='local' and the native sampler)")
        # scores first: a backend that cannot score refuses before anything is generated
        scores = None if k is None else await score(prompts, k, params.temperature)
        groups = await generate(prompts, params, request)
        return completion_response(body, prompts, groups, tokenizer, model, want_lp, params, scores)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await read_json(request)
        params = sampling_params(body, _CHAT_KEYS, window=max_len)
        if body.get("prompt_logprobs") is not None:
            raise ValueError("prompt_logprobs is served on /v1/completions (send the rendered token ids)")
        want_lp = _chat_logprobs(body)
        if body.get("tool_choice") not in (None, "none"):
            raise ValueError("tool_choice other than 'none' is not supported")
        prompt = await asyncio.to_thread(chat_prompt, body, tokenizer)  # off the event loop
        groups = await generate([prompt], params, request)
        return chat_response(body, prompt, groups[0], tokenizer, model, want_lp, params)

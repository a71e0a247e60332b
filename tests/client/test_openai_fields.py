"""Request fields of the vLLM-style generation routes that change what comes back, read as vLLM
reads them (tiny random qwen3, fp32, CPU; the server app over a sampler alone, no trainer):

- ``max_tokens``: absent on ``/v1/completions``: 16; null there, or absent on chat: up to the end
  of the model window (vLLM's ``get_max_tokens``); chat's ``max_completion_tokens`` first; a
  route that does not know the window refuses a null rather than run 16 tokens;
- a choice's text leaves out the stop token that ended it unless ``include_stop_str_in_output``
  (vLLM's detokenizer); ``token_ids`` keep it either way;
- chat's ``logprobs`` is a bool and ``top_logprobs`` > 0 is refused with or without it.

(Before: chat without ``max_tokens`` and a null ``max_tokens`` ran 16 tokens and answered
``finish_reason="length"``; the text held the stop token; ``include_stop_str_in_output`` and
``max_completion_tokens`` got 400; chat ``logprobs: 0`` returned log-probs and ``top_logprobs: 3``
without ``logprobs`` was accepted.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from polynya import SamplingParams
from polynya.client.ecosystem import generate_params
from polynya.client.server import create_app
from polynya.config.sampler import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.models import load_tokenizer

WINDOW = 40  # a short model window: a completion that runs to its end stays cheap
PROMPT = [5, 6, 7, 8, 9, 10]


class SamplerOnly:
    """What the generation routes use of a ``LocalClient``: its samplers and ``generate_async``."""

    def __init__(self, engine: SamplingEngine) -> None:
        self.samplers = [engine]
        self.config = SimpleNamespace(model_name="tiny")
        self.sampler_asleep = False

    async def generate_async(self, prompts, params):
        return await self.samplers[0].generate_async(prompts, params)


@pytest.fixture(scope="module")
def engine():
    return SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu", block_size=4,
                                        num_blocks=64, max_model_len=WINDOW))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:qwen3")


@pytest.fixture(scope="module")
def http(engine, tok, tmp_path_factory):
    app = create_app(SamplerOnly(engine), tokenizer=tok, run_dir=tmp_path_factory.mktemp("run"))
    with TestClient(app) as c:
        yield c


def post(http, route: str, body: dict) -> dict:
    r = http.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(engine, prompt, max_tokens, **kw):
    """The engine's own greedy run, EOS off: what a route asked for ``max_tokens`` must return."""
    return engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    stop_at_eos=False, **kw))[0][0]


def test_max_tokens_null_or_absent_on_chat_runs_to_the_end_of_the_window(http, engine, tok):
    base = {"temperature": 0, "ignore_eos": True}
    full = greedy(engine, PROMPT, WINDOW)
    assert len(full.token_ids) == WINDOW - len(PROMPT) and full.finish_reason == "length"
    c = post(http, "/v1/completions", {**base, "prompt": PROMPT, "max_tokens": None})["choices"][0]
    assert (c["token_ids"], c["finish_reason"]) == (full.token_ids, "length")
    c = post(http, "/v1/completions", {**base, "prompt": PROMPT})["choices"][0]
    assert c["token_ids"] == full.token_ids[:16]  # absent on a completion request: vLLM's 16

    messages = [{"role": "user", "content": "how many apples"}]
    rendered = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    want = greedy(engine, rendered, WINDOW).token_ids
    assert len(want) == WINDOW - len(rendered) > 16
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        c = post(http, "/v1/chat/completions", {**base, "messages": messages, **extra})["choices"][0]
        assert (c["token_ids"], c["finish_reason"]) == (want, "length"), extra
    c = post(http, "/v1/chat/completions", {**base, "messages": messages, "max_tokens": 9,
                                            "max_completion_tokens": 3})["choices"][0]
    assert c["token_ids"] == want[:3]  # max_completion_tokens first, as vLLM reads them


def test_a_route_that_does_not_know_the_window_refuses_a_null_max_tokens(tok, tmp_path):
    assert generate_params({}).max_tokens == 16
    with pytest.raises(ValueError, match="max_tokens"):
        generate_params({"max_tokens": None})  # /inference/v1/generate: not a silent 16
    blind = SamplerOnly(None)
    blind.samplers = []  # a client whose samplers live elsewhere: no window to read
    with TestClient(create_app(blind, tokenizer=tok, run_dir=tmp_path)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]


def test_text_leaves_out_the_stop_token_unless_asked(http, engine, tok):
    free = greedy(engine, PROMPT, 12).token_ids
    at = next(i for i, t in enumerate(free) if i > 0 and tok.decode([t]).strip()
              and t not in free[:i])  # a stop token with visible text, first seen at i
    stop, ids = free[at], free[:at + 1]
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 12, "stop_token_ids": [stop]}
    c = post(http, "/v1/completions", body)["choices"][0]
    assert (c["token_ids"], c["finish_reason"], c["stop_reason"]) == (ids, "stop", stop)
    assert c["text"] == tok.decode(ids[:-1])
    c = post(http, "/v1/completions", {**body, "include_stop_str_in_output": True})["choices"][0]
    assert c["token_ids"] == ids and c["text"] == tok.decode(ids)
    c = post(http, "/v1/completions", {**body, "max_tokens": at})["choices"][0]
    assert c["finish_reason"] == "length" and c["text"] == tok.decode(free[:at])  # no stop: all text

    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8,
            "ignore_eos": True}
    first = post(http, "/v1/chat/completions", chat)["choices"][0]["token_ids"]
    c = post(http, "/v1/chat/completions", {**chat, "stop_token_ids": [first[2]]})["choices"][0]
    cut = first[:first.index(first[2]) + 1]
    assert c["token_ids"] == cut and c["message"]["content"] == tok.decode(cut[:-1])


@pytest.mark.parametrize("fields, match", [
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs=3"),
    ({"top_logprobs": 2}, "top_logprobs=2"),
    ({"logprobs": 0}, "logprobs must be true or false"),
    ({"logprobs": 1}, "logprobs must be true or false"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be true or false"),
])
def test_chat_logprob_fields_that_would_be_misread_are_refused(http, fields, match):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, **fields})
    assert r.status_code == 400 and match in r.json()["error"], r.text


def test_chat_logprobs_true_returns_the_sampled_tokens_logprobs(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1}
    c = post(http, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 0})["choices"][0]
    assert len(c["logprobs"]["content"]) == len(c["token_ids"]) == 3
    assert all(x["logprob"] <= 0 for x in c["logprobs"]["content"])
    assert post(http, "/v1/chat/completions", {**body, "logprobs": False})["choices"][0]["logprobs"] is None

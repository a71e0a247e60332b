"""SkyRL 0.4's own ``RemoteInferenceClient`` and ``SkyrlWeightSyncClient`` drive polynya's HTTP
server through a full cycle: generate, pause (keep / wait / abort) with requests in flight
(abort: partial tokens and log-probs, stop reason "abort", then resume),
sleep / is_sleeping / wake, a weight update with an explicit version, generate again on the new
weights. Every answer is checked against a plain-torch reference on the same weights.

The trainer side of the weight broadcast is played by the test with polynya's ``SyncGroup``
(rank 0): SkyRL's real sender is vLLM's NCCL engine, which needs vLLM and CUDA.
"""
from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
import torch
from polynya.checksum import checksum_named_tensors
from polynya.models import load_model, load_tokenizer
from polynya.sync import SyncGroup
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
    RemoteInferenceClient,
)
from skyrl.backends.skyrl_train.weight_sync.control_plane import (
    SkyrlWeightSyncClient,
    nccl_init_payloads,
)
from skyrl.train.config import SamplingParams

from ...engines.sample.vllm_reference import masked_greedy
from .conftest import free_port

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 99, 3, 12, 64]]


def stop_ids(model) -> set[int]:
    eos = model.config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or ())


def sampling(max_tokens: int, **extra) -> dict:
    """The dict SkyRL's generator sends (its own builder), greedy."""
    return get_vllm_sampling_params(SamplingParams(
        max_generate_length=max_tokens, temperature=0.0, logprobs=0, additional_kwargs=extra or None))


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def models():
    return {0: load_model("tiny:qwen3", dtype="float32", seed=0).eval(),
            1: load_model("tiny:qwen3", dtype="float32", seed=1).eval()}


def client_for(url: str) -> RemoteInferenceClient:
    return RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1,
                                 model_name="tiny:qwen3")


async def generate(url: str, params: dict, prompts=PROMPTS):
    client = client_for(url)
    try:
        return await client.generate({"prompt_token_ids": prompts, "sampling_params": params})
    finally:
        await client.teardown()


def check_generation(out, model, tok, max_tokens):
    stop = stop_ids(model)
    for i, prompt in enumerate(PROMPTS):
        want, want_lp = masked_greedy(model, prompt, max_tokens, stop, 1)  # SkyRL sends min_tokens=1
        assert out["response_ids"][i] == want, f"prompt {i}"
        assert out["response_logprobs"][i] == pytest.approx(want_lp, abs=1e-4), f"prompt {i}"
        assert out["stop_reasons"][i] == ("stop" if want[-1] in stop else "length")
        assert out["responses"][i] == tok.decode(want)  # through the server's /detokenize


def test_full_cycle(polynya_server, models):
    url, tok = polynya_server, load_tokenizer("tiny:qwen3")
    client = client_for(url)

    # --- the server holds the seed-0 weights; world size as SkyRL's init reads it
    sums = get_json(f"{url}/rl/weight_checksums")
    assert sums["samplers"] == [checksum_named_tensors(models[0].named_parameters())], (
        "server weights differ from load_model('tiny:qwen3', seed=0) here: torch versions differ?")
    assert run(client.get_world_size()) == (1, 1)

    # --- generate: SkyRL's generator payload, greedy, checked token by token
    first = run(generate(url, sampling(8)))
    check_generation(first, models[0], tok, 8)

    # --- tokenize / detokenize / chat completions through SkyRL's client (no local tokenizer)
    async def text_routes():
        c = client_for(url)
        try:
            ids = await c.tokenize(["hello world", "polynya"], add_special_tokens=False)
            texts = await c.detokenize(ids)
            chat = await c.chat_completion({"json": {
                "messages": [{"role": "user", "content": "hi there"}],
                "max_tokens": 6, "temperature": 0.0, "logprobs": True}})
            return ids, texts, chat
        finally:
            await c.teardown()

    ids, texts, chat = run(text_routes())
    assert ids == [tok("hello world", add_special_tokens=False)["input_ids"],
                   tok("polynya", add_special_tokens=False)["input_ids"]]
    assert texts == ["hello world", "polynya"]
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "hi there"}],
                                         add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    want, want_lp = masked_greedy(models[0], prompt, 6, stop_ids(models[0]), 0)
    choice = chat["choices"][0]
    assert chat["prompt_token_ids"] == prompt and choice["token_ids"] == want
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == pytest.approx(want_lp, abs=1e-4)
    assert choice["message"] == {"role": "assistant",
                                 "content": tok.decode(want, skip_special_tokens=True)}

    # --- pause: keep, wait and abort with requests in flight
    run(pause_cycle(url, models[0], tok))

    # --- sleep / is_sleeping / wake (SkyRL's colocated sequence: sleep, wake weights, wake kv)
    async def sleep_cycle():
        c = client_for(url)
        try:
            states = [await c.is_sleeping()]
            await c.sleep(level=2)
            states.append(await c.is_sleeping())
            await c.wake_up(tags=["weights"])
            states.append(await c.is_sleeping())
            await c.wake_up(tags=["kv_cache"])
            await c.sleep(level=1)
            states.append(await c.is_sleeping())
            await c.wake_up()
            states.append(await c.is_sleeping())
            return states
        finally:
            await c.teardown()

    assert run(sleep_cycle()) == [False, True, False, True, False]

    # --- weight update with an explicit version through SkyRL's weight-sync client
    push_weights(url, models[1], weight_version="7")
    sums = get_json(f"{url}/rl/weight_checksums")
    assert sums["versions"] == [7]
    assert sums["samplers"] == [checksum_named_tensors(models[1].named_parameters())]

    # --- generate again: the new weights answer, and the answers changed
    second = run(generate(url, sampling(8)))
    check_generation(second, models[1], tok, 8)
    assert second["response_ids"] != first["response_ids"]


async def pause_in_flight(c, url: str, mode: str, warmup: float = 0.2):
    """Start long generations (no stop) and pause ``warmup`` seconds later, while all of them
    run; returns the running task, its length and the pause answer. The timing adapts to the
    machine: a generation that ended, or a pause that reached the server before every request,
    is retried longer."""
    tokens = 100
    for _ in range(4):
        running = asyncio.create_task(generate(url, sampling(tokens, ignore_eos=True)))
        await asyncio.sleep(warmup)
        if not running.done():
            answer = (await c.pause(mode=mode))[url]["body"]
            # SkyRL sends one HTTP request per prompt: all of them must have been running
            if answer["in_flight_at_pause"] == len(PROMPTS):
                return running, tokens, answer
            await c.resume()
        await running
        tokens *= 3
    raise AssertionError(f"could not pause (mode={mode}) with all requests in flight")


async def pause_cycle(url: str, model, tok) -> None:
    c = client_for(url)
    try:
        for mode in ("keep", "wait"):
            running, tokens, answer = await pause_in_flight(c, url, mode)
            assert answer == {"status": "paused", "mode": mode, "in_flight_at_pause": len(PROMPTS)}
            if mode == "wait":  # returned only once nothing ran any more
                out = await asyncio.wait_for(running, 5)
            held = asyncio.create_task(generate(url, sampling(8)))
            if mode == "keep":  # the in-flight requests go on while paused
                out = await asyncio.wait_for(running, 120)
            assert all(len(r) == tokens for r in out["response_ids"])
            assert out["stop_reasons"] == ["length"] * len(PROMPTS)
            await asyncio.sleep(0.5)
            assert not held.done(), f"a request started while paused (mode={mode})"
            await c.resume()
            check_generation(await asyncio.wait_for(held, 60), model, tok, 8)
        await check_abort(c, url, model, tok)
    finally:
        await c.teardown()


async def check_abort(c, url: str, model, tok) -> None:
    """pause(mode="abort") with requests in flight: each comes back at once as SkyRL expects
    from vLLM (partial tokens, their log-probs, stop reason "abort"); new requests wait for
    resume; afterwards the server answers exactly as before and holds no request."""
    for warmup in (0.2, 0.6, 1.8):  # a loaded machine may not have started decoding yet
        running, tokens, answer = await pause_in_flight(c, url, "abort", warmup)
        assert answer == {"status": "paused", "mode": "abort", "in_flight_at_pause": len(PROMPTS)}
        out = await asyncio.wait_for(running, 30)  # answered before pause returned: only the
        # client's own /detokenize calls remain
        if any(len(r) >= 2 for r in out["response_ids"]):
            break
        await c.resume()
    else:
        raise AssertionError("no request was decoding when aborted, three times")
    assert out["stop_reasons"] == ["abort"] * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        ids = out["response_ids"][i]
        assert len(ids) < tokens, f"prompt {i}: not aborted"
        want, want_lp = masked_greedy(model, prompt, len(ids), set(), 1)  # ignore_eos
        assert ids == want and out["responses"][i] == tok.decode(ids)
        # SkyRL reads an empty log-prob list (aborted before its first token) as None
        assert out["response_logprobs"][i] == (pytest.approx(want_lp, abs=1e-4) if ids else None)
    held = asyncio.create_task(generate(url, sampling(8)))
    await asyncio.sleep(0.5)
    assert not held.done(), "a request started while paused (mode=abort)"
    await c.resume()
    check_generation(await asyncio.wait_for(held, 60), model, tok, 8)
    # nothing left in flight: a wait-pause returns at once
    assert (await c.pause(mode="wait"))[url]["body"]["in_flight_at_pause"] == 0
    await c.resume()


def push_weights(url: str, model, weight_version: str) -> None:
    """SkyRL's control-plane calls, with the test as the broadcasting trainer (rank 0)."""
    named = list(model.named_parameters())
    port = free_port()
    wsc = SkyrlWeightSyncClient([url], 1, init_payload_fn=nccl_init_payloads)
    errors: list[BaseException] = []

    def in_thread(fn, *args):
        def body():
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                errors.append(exc)
        t = threading.Thread(target=body)
        t.start()
        return t

    try:
        t = in_thread(wsc.init_weight_transfer_engine, {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2})
        group = SyncGroup("127.0.0.1", port, rank=0, world_size=2, device="cpu")
        t.join(60)
        assert not errors, errors
        wsc.start_weight_update()
        info = {"names": [n for n, _ in named], "dtype_names": ["float32"] * len(named),
                "shapes": [list(p.shape) for _, p in named], "packed": True}
        t = in_thread(wsc.update_weights, info)
        flat = torch.cat([p.detach().reshape(-1) for _, p in named])
        group.broadcast(flat, 0).wait()
        t.join(60)
        assert not errors, errors
        wsc.finish_weight_update(weight_version=weight_version)
    finally:
        wsc.close()


def post_json(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_special_tokens": True}, "add_special_tokens"),
])
def test_tokenize_refuses_what_it_would_ignore(polynya_server, extra, field):
    """vLLM's chat ``/tokenize`` renders ``tools`` / ``continue_final_message`` into the prompt
    and adds special tokens when asked; the route used to drop them and return other tokens."""
    messages = [{"role": "user", "content": "hi there"}]
    tok = load_tokenizer("tiny:qwen3")
    status, out = post_json(f"{polynya_server}/tokenize",
                            {"messages": messages, "add_generation_prompt": False})
    text = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert status == 200 and out["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    status, out = post_json(f"{polynya_server}/tokenize", {"messages": messages, **extra})
    assert status == 400, out
    assert field in json.dumps(out)

"""A generation whose HTTP client goes away is aborted in the engine (tiny:qwen3, fp32, CPU).

The server on loopback (``serving.served``) with the sampler's steps slowed to >= 10 ms, so a
victim asking for 300 tokens is always mid-generation when its socket closes, however late a
loaded machine schedules the test. Checked: the engine's ``aborted_requests`` grows by the
victim's engine requests, its KV pages are freed (``blocks_in_use`` back to the baseline), a
neighbour running in the same batch answers exactly as its sequential twin (seeded), and the
server answers a new request correctly. Also the facade's per-call abort
(``SamplingEngine.generate(..., request_id=)`` / ``abort([request_id])``) on its own.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from polynya import SamplingParams
from polynya.client.local import LocalClient
from polynya.client.server import create_app

from .common import tiny_config
from .serving import served

VICTIM = [11, 12, 13, 14, 15, 16, 17, 18, 19]
NEIGHBOUR = [40, 41, 42, 43, 44]


def wait_until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    local = LocalClient(tiny_config("local", sampling={"num_blocks": 384, "block_size": 8,
                                                         "max_num_seqs": 32}))
    runner = local.samplers[0].backend.runner
    run_step = runner.run

    def slow_step(*args, **kwargs):  # >= 3 s for the victim's 300 tokens: it is always
        time.sleep(0.01)             # mid-generation when its client leaves
        return run_step(*args, **kwargs)

    runner.run = slow_step
    app = create_app(local, run_dir=tmp_path_factory.mktemp("run"))
    with served(app) as url:
        yield local, url
    local.shutdown()


def running(engine, prompt: list[int]) -> list:
    """The engine's running sequences of ``prompt`` that have sampled at least one token."""
    return [s for s in list(engine.scheduler.running)
            if s.token_ids[:s.num_prompt_tokens] == prompt and s.completion]


def send_and_leave_open(url: str, path: str, body: dict) -> socket.socket:
    """POST ``body`` on a raw socket without reading the answer (the caller closes it)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def completion(url: str, prompt: list[int], **params) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, **params}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(answer: dict) -> list[tuple[list[int], str]]:
    return [(c["token_ids"], c["finish_reason"]) for c in answer["choices"]]


VICTIMS = {  # per route, a request body and the engine requests (prompts) it maps to
    "/v1/completions": ({"prompt": VICTIM, "n": 2, "max_tokens": 300, "temperature": 1.0,
                         "seed": 3, "ignore_eos": True}, 1),
    "/inference/v1/generate": ({"token_ids": [VICTIM, VICTIM[:6]], "sampling_params": {
        "n": 2, "max_tokens": 300, "temperature": 1.0, "seed": 3, "ignore_eos": True}}, 2),
    "/rl/generate": ({"prompts": [VICTIM, VICTIM[:7], VICTIM[:5]], "params": {
        "n": 2, "max_tokens": 300, "temperature": 1.0, "stop_token_ids": []}}, 3),
}


@pytest.mark.parametrize("path", list(VICTIMS))
def test_disconnect_aborts_only_that_request(server, path):
    local, url = server
    engine = local.samplers[0].backend
    before = engine.stats()
    assert before["blocks_in_use"] == 0
    victim, n_victim = VICTIMS[path]
    neighbour = {"n": 2, "max_tokens": 40, "temperature": 0.9, "seed": 5, "ignore_eos": True}

    sock = send_and_leave_open(url, path, victim)
    wait_until(lambda: len(running(engine, VICTIM)) == 2, "the victim to be decoding")
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(completion(url, NEIGHBOUR, **neighbour)))
    thread.start()
    wait_until(lambda: len(running(engine, NEIGHBOUR)) == 2, "the neighbour to be decoding")
    sock.close()  # the client goes away mid-generation
    wait_until(lambda: engine.stats()["aborted_requests"] == before["aborted_requests"] + n_victim,
               "the victim's abort")
    assert not running(engine, VICTIM)
    thread.join(30)
    assert not thread.is_alive()

    after = engine.stats()
    assert after["blocks_in_use"] == before["blocks_in_use"]  # every page back
    assert after["decode_tokens"] - before["decode_tokens"] < 2 * 300, "the victim ran to its end"
    assert after["requests"] == before["requests"] + n_victim + 1
    twin = completion(url, NEIGHBOUR, **neighbour)  # alone, after: same seed, same tokens
    assert tokens(answer) == tokens(twin)
    assert [len(t) for t, _ in tokens(twin)] == [40, 40]
    assert engine.stats()["blocks_in_use"] == before["blocks_in_use"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_facade_aborts_a_named_call_and_leaves_the_rest(server):
    local, _ = server
    sampler = local.samplers[0]
    engine = sampler.backend
    params = SamplingParams(n=2, max_tokens=300, temperature=1.0, seed=9, logprobs=True,
                            stop_token_ids=())
    other = SamplingParams(n=1, max_tokens=30, temperature=0.8, seed=4, logprobs=True,
                           stop_token_ids=())
    with pytest.raises(ValueError, match="list of request ids"):
        sampler.abort("call-a")
    out: dict = {}
    threads = [threading.Thread(target=lambda: out.update(a=sampler.generate(
                   [VICTIM], params, request_id="call-a"))),
               threading.Thread(target=lambda: out.update(b=sampler.generate(
                   [NEIGHBOUR], other, request_id="call-b")))]
    threads[0].start()
    wait_until(lambda: len(running(engine, VICTIM)) == 2, "call-a to be decoding")
    with pytest.raises(ValueError, match="already in flight"):
        sampler.generate([VICTIM], params, request_id="call-a")
    threads[1].start()
    wait_until(lambda: len(running(engine, NEIGHBOUR)) == 1, "call-b to be decoding")
    assert sampler.abort(["call-a", "no-such-call"]) == 1
    for t in threads:
        t.join(30)
    assert all(s.finish_reason == "abort" and 0 < len(s.token_ids) < 300
               and len(s.logprobs) == len(s.token_ids) for s in out["a"][0])
    twin = sampler.generate([NEIGHBOUR], other)
    assert [s.token_ids for s in out["b"][0]] == [s.token_ids for s in twin[0]]
    assert out["b"][0][0].finish_reason == "length"
    assert sampler.abort(["call-a"]) == 0  # finished calls are forgotten
    assert engine.stats()["blocks_in_use"] == 0


def test_facade_abort_before_the_call_is_queued(server):
    """A call named by ``abort`` before its requests were queued is stopped as they are."""
    local, _ = server
    sampler = local.samplers[0]
    engine = sampler.backend
    before = engine.stats()
    params = SamplingParams(n=3, max_tokens=50, temperature=1.0, seed=1, logprobs=True)
    with engine._intake_lock:  # hold the engine's queue: the call registers, then waits here
        thread = threading.Thread(target=lambda: out.append(sampler.generate(
            [VICTIM, NEIGHBOUR], params, request_id="early")))
        out: list = []
        thread.start()
        wait_until(lambda: "early" in sampler._calls, "the call to be named")
        assert sampler.abort(["early"]) == 0  # not queued yet: nothing stopped now
    thread.join(30)
    assert [[(s.token_ids, s.finish_reason) for s in g] for g in out[0]] == [[([], "abort")] * 3] * 2
    after = engine.stats()
    assert after["aborted_requests"] == before["aborted_requests"] + 2
    assert after["decode_tokens"] == before["decode_tokens"] and after["blocks_in_use"] == 0


def test_disconnect_while_paused_runs_nothing_for_nobody(server):
    """A client that leaves while the gate holds its request (``/pause``): whether the server
    notices before or after ``/resume``, no token is decoded for it and no page is kept."""
    local, url = server
    engine = local.samplers[0].backend
    before = engine.stats()
    assert httpx.post(f"{url}/pause").status_code == 200
    try:
        sock = send_and_leave_open(url, "/v1/completions", VICTIMS["/v1/completions"][0])
        time.sleep(0.05)
        sock.close()
    finally:
        assert httpx.post(f"{url}/resume").status_code == 200
    answer = completion(url, NEIGHBOUR, max_tokens=4, seed=2, ignore_eos=True)  # the server still serves
    assert [len(t) for t, _ in tokens(answer)] == [4]
    after = engine.stats()
    started = after["requests"] - before["requests"] - 1
    assert started in (0, 1) and after["aborted_requests"] - before["aborted_requests"] == started
    assert after["decode_tokens"] - before["decode_tokens"] < 300
    assert after["blocks_in_use"] == 0


def test_cancelled_handler_aborts_its_requests(server):
    """The handler task cancelled (server shutdown, a timeout middleware) rather than a
    disconnect: ``Generations`` aborts the call's engine requests before re-raising."""
    import asyncio

    from polynya.client.cancel import Generations

    local, _ = server
    engine = local.samplers[0].backend
    before = engine.stats()
    generations = Generations(local)
    params = SamplingParams(n=2, max_tokens=300, temperature=1.0, seed=8, stop_token_ids=())

    async def scenario():
        task = asyncio.ensure_future(generations(None, [VICTIM], params))
        while len(running(engine, VICTIM)) < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    after = engine.stats()  # the abort was applied before the task ended
    assert after["aborted_requests"] == before["aborted_requests"] + 1
    assert after["blocks_in_use"] == 0 and not running(engine, VICTIM)


def test_disconnect_while_waiting_for_the_hand_over(server):
    """A client that leaves while its generate waits for the client's hand-over lock (a
    training step, a weight sync): the call is named from the start, so it is stopped as it
    reaches the sampler — not a single token decoded for it."""
    local, url = server
    sampler = local.samplers[0]
    engine = sampler.backend
    before = engine.stats()
    with local._lock:  # what a long training step holds
        sock = send_and_leave_open(url, "/v1/completions", VICTIMS["/v1/completions"][0])
        wait_until(lambda: len(sampler._calls) == 1, "the call to be named")
        sock.close()
        wait_until(lambda: all(c.aborted for c in list(sampler._calls.values())), "the abort")
    wait_until(lambda: not sampler._calls, "the call to return")
    after = engine.stats()
    assert after["requests"] == before["requests"] + 1
    assert after["aborted_requests"] == before["aborted_requests"] + 1
    assert after["decode_tokens"] == before["decode_tokens"] and after["blocks_in_use"] == 0
    answer = completion(url, NEIGHBOUR, max_tokens=4, seed=2, ignore_eos=True)
    assert [len(t) for t, _ in tokens(answer)] == [4]


def test_cancelled_generate_async_aborts_its_call(server):
    """Cancelling ``LocalClient.generate_async`` (an unnamed call) aborts it in the engine before
    the cancellation reaches the caller, and the client serves the next call exactly."""
    import asyncio

    local, _ = server
    engine = local.samplers[0].backend
    before = engine.stats()
    params = SamplingParams(n=2, max_tokens=300, temperature=1.0, seed=8, stop_token_ids=())

    async def scenario():
        task = asyncio.ensure_future(local.generate_async([VICTIM], params))
        while len(running(engine, VICTIM)) < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return engine.stats()  # read as the cancellation arrives: the abort is already applied

    at_cancel = asyncio.run(scenario())
    assert at_cancel["aborted_requests"] == before["aborted_requests"] + 1
    assert at_cancel["blocks_in_use"] == 0 and not running(engine, VICTIM)
    assert at_cancel["decode_tokens"] - before["decode_tokens"] < 2 * 300
    short = SamplingParams(n=1, max_tokens=5, temperature=0.0, stop_token_ids=())
    again = local.generate([NEIGHBOUR], short)
    assert [s.finish_reason for s in again[0]] == ["length"] and len(again[0][0].token_ids) == 5

"""Abort in the native sampling engine (tiny:qwen3, fp32, CPU).

An aborted request returns what it sampled so far — tokens, their log-probs (checked against a
teacher-forced forward of the same tokens), ``finish_reason="abort"`` — its pages go back to the
block manager, and every other request of the batch ends exactly as it would have alone.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from polynya import SamplingParams
from polynya.models import load_model

from .test_native_engine import hf_greedy, make_engine, ragged_prompts, teacher_forced_logprobs


@pytest.fixture(scope="module")
def hf_qwen():
    return load_model("tiny:qwen3", dtype="float32")


def check_logprobs(model, prompt, sample, temperature: float) -> None:
    """The sample's log-probs are those of its tokens under the model at ``temperature``."""
    if not sample.token_ids:
        assert sample.logprobs == []
        return
    logits = teacher_forced_logprobs(model, prompt, sample.token_ids) / temperature
    ref = logits.log_softmax(-1).gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(sample.logprobs), ref, rtol=0, atol=1e-5)


def pages_of_running(backend) -> set[int]:
    return {b for s in backend.scheduler.running for b in s.block_table}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_one_request_between_steps(hf_qwen, async_scheduling):
    """Abort one request of three after a few decode steps: it comes back partial, its pages
    are freed, and its neighbours equal their sequential twins token for token. With async
    scheduling the sixth step is already on the device when the abort comes: the abort lands
    after it (as it would without async scheduling one step later)."""
    engine = make_engine(async_scheduling=async_scheduling)
    eng = engine.backend
    prompts = ragged_prompts(21, [7, 13, 10])
    params = [SamplingParams(n=2, temperature=0.9, max_tokens=14, seed=11, logprobs=True, stop_token_ids=()),
              SamplingParams(n=3, temperature=1.0, top_k=50, max_tokens=14, seed=12, logprobs=True,
                             stop_token_ids=()),
              SamplingParams(temperature=0.8, max_tokens=14, seed=13, logprobs=True, stop_token_ids=())]
    assert eng.stats()["blocks_in_use"] == 0
    toks, plist = eng.validate(prompts, params)
    rids = [eng.add_request(t, p) for t, p in zip(toks, plist)]
    for _ in range(5):  # one prefill (three prompts fit) + four decode steps
        eng.step()
    victim = [s for s in eng.scheduler.running if s.request_id == rids[1]]
    assert len(victim) == 3 and all(len(s.completion) == 5 for s in victim)

    assert eng.abort([rids[1], 10_000]) == 1  # an unknown id is ignored
    assert all(s.block_table == [] for s in victim)
    assert eng.stats()["blocks_in_use"] == len(pages_of_running(eng))  # only the neighbours' pages
    assert sum(eng.block_manager.ref_count) == sum(len(s.block_table) for s in eng.scheduler.running)
    assert eng.abort([rids[1]]) == 0  # already aborted: nothing left to stop

    out = eng.wait(rids)
    assert [len(o) for o in out] == [2, 3, 1]
    for s in out[1]:
        assert s.finish_reason == "abort" and len(s.token_ids) == 5 + async_scheduling == len(s.logprobs)
    logits = [teacher_forced_logprobs(hf_qwen, prompts[1], s.token_ids) for s in out[1]]
    for s, lg in zip(out[1], logits):  # top-k 50 then the sampled token's log-prob
        kth = lg.topk(50, dim=-1).values[:, -1:]
        ref = lg.masked_fill(lg < kth, float("-inf")).log_softmax(-1)
        ref = ref.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, rtol=0, atol=1e-5)
    assert len({tuple(s.token_ids) for s in out[1]}) > 1, "the forks were sampled independently"

    for i in (0, 2):  # the neighbours ran to the end, as they do alone
        twin = make_engine().generate([prompts[i]], params[i])[0]
        assert [s.token_ids for s in out[i]] == [s.token_ids for s in twin]
        assert all(s.finish_reason == "length" and len(s.token_ids) == 14 for s in out[i])
        for s, t in zip(out[i], twin):
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(t.logprobs), rtol=0, atol=1e-5)
    stats = eng.stats()
    assert stats["blocks_in_use"] == 0 and stats["aborted_requests"] == 1
    assert not eng.scheduler.has_work() and not eng._requests


def test_abort_before_prefill_gives_empty_samples():
    engine = make_engine()
    eng = engine.backend
    (tok,), (p,) = eng.validate([[5, 6, 7, 8, 9]], SamplingParams(n=3, max_tokens=4, logprobs=True))
    rid = eng.add_request(tok, p)
    assert eng.abort() == 1
    out = eng.wait([rid])[0]
    assert [(s.token_ids, s.logprobs, s.finish_reason) for s in out] == [([], [], "abort")] * 3
    assert eng.stats()["blocks_in_use"] == 0 and not eng.scheduler.has_work()


def test_abort_all_from_another_thread_while_generate_runs(hf_qwen):
    """``SamplingEngine.abort`` while a ``generate`` call decodes on another thread: the call
    returns partial samples instead of raising; the engine then serves new requests as before."""
    engine = make_engine()
    runner = engine.backend.runner
    run_step = runner.run

    def slow_step(*args, **kwargs):  # >= 10 ms a step: the abort lands mid-generation however
        time.sleep(0.01)             # late a loaded machine schedules this thread
        return run_step(*args, **kwargs)

    runner.run = slow_step
    prompts = ragged_prompts(22, [9, 6])
    p = SamplingParams(n=2, temperature=1.0, max_tokens=400, seed=7, logprobs=True, stop_token_ids=())
    assert engine.abort() == 0  # nothing in flight
    result: dict[str, object] = {}

    def run():
        try:
            result["out"] = engine.generate(prompts, p)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 60
    while engine.stats()["decode_steps"] < 3:
        assert time.time() < deadline and t.is_alive(), "generate did not start decoding"
        time.sleep(0.005)
    assert engine.abort() == 2
    t.join(30)
    assert not t.is_alive() and "error" not in result, result.get("error")
    out = result["out"]
    for prompt, samples in zip(prompts, out):
        assert len(samples) == 2
        for s in samples:
            assert s.finish_reason == "abort" and 3 <= len(s.token_ids) < 400
            check_logprobs(hf_qwen, prompt, s, 1.0)
    stats = engine.stats()
    assert stats["blocks_in_use"] == 0 and stats["aborted_requests"] == 2
    runner.run = run_step
    # the engine is consistent afterwards: a seeded request equals a fresh engine's answer
    q = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, stop_token_ids=())
    again = engine.generate(prompts, q)
    fresh = make_engine().generate(prompts, q)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in fresh]
    assert all(s.finish_reason == "length" for g in again for s in g)


def test_abort_reaches_preempted_sequences(hf_qwen):
    """A cache too small for the batch: sequences preempted back to the waiting queue are
    aborted too, keeping the tokens they had (a prefix of the greedy answer)."""
    engine = make_engine(num_blocks=14, max_num_seqs=8)
    eng = engine.backend
    prompts = ragged_prompts(12, [10, 7])
    toks, plist = eng.validate(prompts, SamplingParams(n=4, temperature=0, max_tokens=14, stop_token_ids=()))
    rids = [eng.add_request(t, p) for t, p in zip(toks, plist)]
    while eng.scheduler.num_preemptions == 0 or not any(s.completion for s in eng.scheduler.waiting):
        eng.step()
    assert eng.abort() == 2
    out = eng.wait(rids)
    assert eng.stats()["blocks_in_use"] == 0
    for prompt, samples in zip(prompts, out):
        ref = hf_greedy(hf_qwen, prompt, 14, eos=-1)
        assert len(samples) == 4
        for s in samples:
            assert s.finish_reason == "abort" and s.token_ids == ref[:len(s.token_ids)]
    assert any(len(s.token_ids) < 14 for g in out for s in g)


def test_a_step_applies_a_queued_abort_that_empties_the_engine():
    """The step loop of a running ``generate`` applies an abort queued by another thread at its
    next step; when nothing is left to run, that step does nothing (no forward, no error)."""
    eng = make_engine().backend
    (tok,), (p,) = eng.validate([[9, 8, 7, 6]], SamplingParams(max_tokens=50, stop_token_ids=()))
    rid = eng.add_request(tok, p)
    eng.step()
    counts, result = eng.stats(), []
    with eng._lock:  # as a generate's step loop holds it: the abort can only queue its order
        t = threading.Thread(target=lambda: result.append(eng.abort()))
        t.start()
        deadline = time.time() + 10
        while not eng._aborts:
            assert time.time() < deadline
            time.sleep(0.001)
        eng.step()
        assert not eng._aborts and not eng.scheduler.has_work()
    t.join(10)
    assert result == [1]
    after = eng.stats()
    assert after["decode_steps"] == counts["decode_steps"] and after["blocks_in_use"] == 0
    (s,) = eng.wait([rid])[0]
    assert s.finish_reason == "abort" and len(s.token_ids) == 1


def test_an_abort_reaches_a_request_queued_just_before_it(monkeypatch):
    """Requests queue without the step lock; an abort ordered right after its request was
    queued must find it, wherever the step boundary that applies it stands (here: a request
    queued and its abort ordered while another boundary is admitting the queue)."""
    eng = make_engine().backend
    (tok,), (p,) = eng.validate([[9, 8, 7, 6]], SamplingParams(max_tokens=40, stop_token_ids=()))
    real, admitting, result = eng._admit, threading.Event(), {}

    def admit():
        real()
        if not admitting.is_set():  # the first boundary: B queues and orders its abort now
            admitting.set()
            deadline = time.time() + 10
            while not any(o.request_ids == {result.get("rid")} for o in list(eng._aborts)):
                assert time.time() < deadline
                time.sleep(0.001)

    def b():
        admitting.wait(10)
        rid = result["rid"] = eng.add_request(tok, p)
        result["stopped"] = eng.abort([rid])
        result["out"] = eng.wait([rid])

    monkeypatch.setattr(eng, "_admit", admit)
    t = threading.Thread(target=b)
    t.start()
    assert eng.abort([12345]) == 0  # a boundary of its own (an unknown id)
    t.join(30)
    (s,) = result["out"][0]
    assert result["stopped"] == 1 and s.finish_reason == "abort" and s.token_ids == []
    assert eng.stats()["decode_tokens"] == 0 and eng.stats()["blocks_in_use"] == 0


def test_a_call_aborted_at_submit_never_runs_while_others_step(monkeypatch):
    """``on_submit`` answering True (its caller gave up before the requests were queued): the
    requests never run, although another call's steps go on while ``on_submit`` runs."""
    eng = make_engine().backend
    p = SamplingParams(temperature=0, max_tokens=150, stop_token_ids=(), logprobs=True)
    a, b = ragged_prompts(5, [7, 9])
    go, real = threading.Event(), eng.runner.run

    def gated(*args, **kw):  # the background call steps only while ``go`` is set
        assert go.wait(10)
        return real(*args, **kw)

    monkeypatch.setattr(eng.runner, "run", gated)
    go.set()
    bg = threading.Thread(target=lambda: eng.generate([a], p))
    bg.start()
    deadline = time.time() + 10
    while eng._counts["decode_steps"] < 2:
        assert time.time() < deadline
        time.sleep(0.002)
    go.clear()  # the background call waits at its next step (the engine lock held)
    prefill, stepped = eng._counts["prefill_tokens"], {}

    def gave_up(ids):
        start = eng._counts["decode_steps"]
        go.set()  # the other call steps while this one decides
        deadline = time.time() + 10
        while eng._counts["decode_steps"] < start + 3 and time.time() < deadline:
            time.sleep(0.001)
        stepped["n"] = eng._counts["decode_steps"] - start
        return True

    out = eng.generate([b, a], SamplingParams(n=2, max_tokens=5, logprobs=True), on_submit=gave_up)
    bg.join(60)
    after = eng.stats()
    assert stepped["n"] >= 3  # steps ran during on_submit
    assert [[(s.token_ids, s.logprobs, s.finish_reason) for s in g] for g in out] == \
        [[([], [], "abort")] * 2] * 2
    assert after["prefill_tokens"] == prefill and after["aborted_requests"] == 2
    assert after["decode_tokens"] == 149 and after["blocks_in_use"] == 0

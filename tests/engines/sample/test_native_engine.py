"""Native sampling engine end to end on tiny random models (fp32, CPU).

Oracles: HF ``model.generate`` (greedy), a teacher-forced HF forward (log-probs), and the
engine's own stats (one prefill per prompt, cache hits, preemptions).
"""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.engines.sample.native import engine as engine_module
from polynya.models import load_model


def make_engine(model: str = "tiny:qwen3", **kw) -> SamplingEngine:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_blocks": 256, **kw}
    return SamplingEngine(SamplerConfig(model, **kw))


def ragged_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(4, 512, size=n).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new: int, eos: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    toks = out[0, len(prompt):].tolist()
    return toks[:toks.index(eos) + 1] if eos in toks else toks


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits


@pytest.fixture(scope="module")
def qwen():
    return make_engine()


@pytest.fixture(scope="module")
def hf_qwen():
    return load_model("tiny:qwen3", dtype="float32")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_equals_hf_generate_with_preemption(family):
    engine = make_engine(f"tiny:{family}", num_blocks=24, max_num_seqs=6)
    hf = load_model(f"tiny:{family}", dtype="float32")
    prompts = ragged_prompts(1, [3, 17, 9, 30, 5, 22, 13])
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    stats = engine.stats()
    assert stats["preemptions"] > 0, "the cache was meant to be too small for the whole batch"
    assert stats["blocks_in_use"] == 0
    for prompt, samples in zip(prompts, out):
        ref = hf_greedy(hf, prompt, 16, eos=0)
        assert samples[0].token_ids == ref
        assert samples[0].finish_reason == ("stop" if ref[-1] == 0 else "length")


def test_logprobs_equal_teacher_forced_forward(qwen, hf_qwen):
    prompts = ragged_prompts(2, [7, 19])
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=5, logprobs=True, stop_token_ids=()),
              SamplingParams(temperature=0.7, top_k=40, max_tokens=12, seed=6, logprobs=True,
                             stop_token_ids=())]
    out = qwen.generate(prompts, params)
    for prompt, p, samples in zip(prompts, params, out):
        s = samples[0]
        assert len(s.token_ids) == 12 and s.finish_reason == "length"
        logits = teacher_forced_logprobs(hf_qwen, prompt, s.token_ids) / p.temperature
        if p.top_k > 0:
            kth = logits.topk(p.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, rtol=0, atol=1e-5)


def test_seeded_sampling_is_reproducible(qwen):
    prompts = ragged_prompts(3, [5, 11, 8])
    p = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, stop_token_ids=())
    first = qwen.generate(prompts, p)
    # same request inside a different batch (other prompts around it) gives the same samples
    again = qwen.generate([prompts[2], prompts[1]] + ragged_prompts(4, [6]), p)
    assert [s.token_ids for s in first[1]] == [s.token_ids for s in again[1]]
    assert [s.token_ids for s in first[2]] == [s.token_ids for s in again[0]]
    other = qwen.generate(prompts[:1], SamplingParams(n=3, max_tokens=10, seed=99, stop_token_ids=()))
    assert [s.token_ids for s in other[0]] != [s.token_ids for s in first[0]]
    assert len({tuple(s.token_ids) for s in first[0]}) > 1, "forks must not repeat each other"


def test_first_token_distribution_matches_model(qwen, hf_qwen):
    """n forks of one prompt sample the first token from the filtered model distribution."""
    prompt = ragged_prompts(5, [9])[0]
    n = 3000
    engine = make_engine(max_num_seqs=n)
    p = SamplingParams(n=n, temperature=0.05, top_k=6, max_tokens=1, seed=0)
    toks = np.array([s.token_ids[0] for s in engine.generate([prompt], p)[0]])
    logits = teacher_forced_logprobs(hf_qwen, prompt, [0])[0] / p.temperature
    top = logits.topk(6)
    ref = top.values.softmax(-1).numpy()
    freq = np.array([(toks == t).mean() for t in top.indices.tolist()])
    assert freq.sum() == pytest.approx(1.0)
    assert np.all(np.abs(freq - ref) <= 5 * np.sqrt(ref * (1 - ref) / n) + 1e-9), (freq, ref)
    assert engine.stats()["prefill_tokens"] == len(prompt)


def test_n_forks_prefill_once_and_prefix_cache(qwen):
    prompt = ragged_prompts(6, [37])[0]
    before = qwen.stats()
    out = qwen.generate([prompt], SamplingParams(n=8, max_tokens=20, seed=3, stop_token_ids=()))
    mid = qwen.stats()
    assert len(out[0]) == 8 and all(len(s.token_ids) == 20 for s in out[0])
    assert mid["prefill_tokens"] - before["prefill_tokens"] == 37
    assert mid["decode_tokens"] - before["decode_tokens"] == 8 * 19
    assert mid["peak_decode_rows"] == max(before["peak_decode_rows"], 8)  # the 8 forks decode together
    qwen.generate([prompt], SamplingParams(max_tokens=2))
    after = qwen.stats()
    assert after["cache_hit_tokens"] - mid["cache_hit_tokens"] == 36  # 9 full blocks of 4
    assert after["prefill_tokens"] - mid["prefill_tokens"] == 1


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fca_on_off_same_greedy_tokens(family):
    prompts = ragged_prompts(7, [13, 6, 21])
    p = SamplingParams(n=4, temperature=0, max_tokens=12, stop_token_ids=())
    engines = [make_engine(f"tiny:{family}", fca=fca, fca_min_shared_tokens=0) for fca in (True, False)]
    outs = [e.generate(prompts + [prompts[0][:9]], p) for e in engines]
    assert [[s.token_ids for s in o] for o in outs[0]] == [[s.token_ids for s in o] for o in outs[1]]
    assert engines[0].stats()["fca_steps"] > 0 and engines[1].stats()["fca_steps"] == 0


def test_fca_only_when_the_shared_reads_pay():
    """Below ``fca_min_shared_tokens`` saved KV reads a step takes the paged kernel (same
    tokens); at or above it, FCA. Here 4 forks share a 21-token prompt: 5 pages of 4, 3 extra
    readers each -> 60 tokens saved per layer."""
    prompt = ragged_prompts(3, [21])
    p = SamplingParams(n=4, temperature=0, max_tokens=6, stop_token_ids=())
    runs = {}
    for threshold in (60, 61):
        engine = make_engine("tiny:qwen3", fca_min_shared_tokens=threshold)
        runs[threshold] = ([s.token_ids for s in engine.generate(prompt, p)[0]], engine.stats())
    assert runs[60][0] == runs[61][0]
    assert runs[60][1]["fca_steps"] == runs[60][1]["decode_steps"] > 0
    assert runs[61][1]["fca_steps"] == 0


def test_bad_inputs_raise_for_that_request_only(qwen):
    good = [5, 6, 7]
    bad_cases = {
        "empty": ([good, []], SamplingParams(max_tokens=2)),
        "vocab": ([good, [1, 512]], SamplingParams(max_tokens=2)),
        "window": ([good, list(range(4, 4 + 1024))], SamplingParams(max_tokens=2)),
    }
    before = qwen.stats()
    for prompts, p in bad_cases.values():
        with pytest.raises(ValueError, match=r"prompts\[1\]"):
            qwen.generate(prompts, p)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    mutated = SamplingParams(max_tokens=2)
    mutated.max_tokens = 0
    with pytest.raises(ValueError, match=r"params\[1\]"):
        qwen.generate([good, good], [SamplingParams(max_tokens=2), mutated])
    assert qwen.stats()["requests"] == before["requests"]  # nothing was queued
    out = qwen.generate([good], SamplingParams(temperature=0, max_tokens=3, stop_token_ids=()))
    assert len(out[0][0].token_ids) == 3


def test_async_generate_does_not_block_the_loop(qwen):
    prompts = ragged_prompts(8, [5, 9])
    p = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=())
    expected = qwen.generate(prompts, p)

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.create_task(ticker())
        a, b = await asyncio.gather(qwen.generate_async(prompts[:1], p), qwen.generate_async(prompts[1:], p))
        stop.set()
        await t
        return a + b, ticks

    got, ticks = asyncio.run(main())
    assert [s[0].token_ids for s in got] == [s[0].token_ids for s in expected]
    assert ticks > 5


def test_load_weights_sleep_wake():
    engine = make_engine()
    new = load_model("tiny:qwen3", dtype="float32", seed=1)
    prompt = ragged_prompts(9, [11])[0]
    p = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=())
    engine.generate([prompt], p)
    named = dict(new.named_parameters())
    names = list(named)
    flat = torch.cat([named[n].detach().reshape(-1) for n in names])
    with pytest.raises(ValueError, match="flat bucket"):
        engine.load_weights([(names, flat[:-1])])
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.load_weights({"nope.weight": flat[:4]})
    assert engine.stats()["weight_version"] == 0
    old_tokens = engine.generate([prompt], p)[0][0].token_ids
    assert engine.load_weights([(names[:3], torch.cat([named[n].detach().reshape(-1) for n in names[:3]])),
                                *[(n, named[n].detach()) for n in names[3:]]]) == 1
    hits = engine.stats()["cache_hit_tokens"]
    got = engine.generate([prompt], p)[0][0].token_ids
    assert engine.stats()["cache_hit_tokens"] == hits, "the prefix cache must be dropped on update"
    assert got == hf_greedy(new, prompt, 8, eos=-1) and got != old_tokens
    engine.sleep()
    assert engine.backend.runner.kv is None
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([prompt], p)
    engine.wake()
    assert engine.generate([prompt], p)[0][0].token_ids == got
    assert engine.load_weights(dict(new.named_parameters()), version=7) == 7
    assert engine.load_weights((names, flat)) == 8  # one bucket on its own, as export_weights yields it
    with pytest.raises(ValueError, match="flat bucket"):
        engine.load_weights((names, flat[1:]))
    assert engine.stats()["weight_version"] == 8


def test_room_bytes_counts_what_a_wake_brings_back(qwen, monkeypatch):
    """CPU engines need no device room; on a device the room at each sleep level is the
    working-memory estimate, plus the KV cache (level >= 1), plus the weights (level 2)."""
    from polynya.engines.sample.native import model_runner

    assert [qwen.room_bytes(lv) for lv in (0, 1, 2)] == [0, 0, 0]
    runner = qwen.backend.runner
    monkeypatch.setattr(runner, "device", torch.device("cuda"))  # only the arithmetic runs
    rooms = [qwen.room_bytes(lv) for lv in (0, 1, 2)]
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert rooms[0] > model_runner.ROOM_RESERVE
    assert rooms[1] - rooms[0] == runner.kv_bytes() and rooms[2] - rooms[1] == weights
    with pytest.raises(ValueError, match="sleep level"):
        qwen.room_bytes(3)


def test_concurrent_threads_batch_together(qwen):
    prompts = ragged_prompts(10, [4, 8, 12])
    p = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=())
    expected = [s[0].token_ids for s in qwen.generate(prompts, p)]
    results: dict[int, list[int]] = {}

    def worker(i):
        time.sleep(0.01 * i)
        results[i] = qwen.generate([prompts[i]], p)[0][0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(3)] == expected


def test_requests_queue_without_waiting_for_a_step(qwen):
    """A step holds the engine lock for its whole forward; queuing a request does not wait for
    it, and the next step admits every request queued meanwhile at once."""
    eng = qwen.backend
    prompts = ragged_prompts(12, [5, 6, 7, 8])
    p = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=())
    expected = [s[0].token_ids for s in qwen.generate(prompts, p)]
    toks, plist = eng.validate(prompts, p)
    before, rids = eng.stats(), []
    with eng._lock:  # what a step in progress holds
        t = threading.Thread(target=lambda: rids.extend(eng.add_request(x, q)
                                                        for x, q in zip(toks, plist)))
        t.start()
        t.join(10)
        assert not t.is_alive() and len(rids) == 4
        with pytest.raises(RuntimeError, match="in flight"):  # queued requests count
            eng.sleep(1)
        assert not eng.asleep
    out = eng.wait(rids)
    after = eng.stats()
    assert [o[0].token_ids for o in out] == expected
    assert after["prefill_steps"] - before["prefill_steps"] == 1  # admitted together
    assert after["requests"] - before["requests"] == 4 and not eng._requests and not eng._intake


def test_callers_between_steps_are_not_starved_by_decoding(monkeypatch):
    """Every generate call steps the engine in a loop; while 8 of them decode, ``stats``,
    ``load_weights`` and ``prompt_logprobs`` each get in at the next step boundary (a plain
    lock let them wait ~15-90 steps: a /pause came after requests had finished)."""
    eng = make_engine(num_blocks=512).backend
    run = eng.runner.run

    def slow_step(*args, **kwargs):  # a step that takes a while, as a GPU forward does
        time.sleep(0.003)
        return run(*args, **kwargs)

    monkeypatch.setattr(eng.runner, "run", slow_step)
    weights = {n: p.detach().clone() for n, p in eng.runner.model.named_parameters()}
    p = SamplingParams(temperature=0, max_tokens=300, stop_token_ids=())
    prompts = ragged_prompts(12, [5] * 8)
    outs: list = []
    calls = [threading.Thread(target=lambda x=x: outs.append(eng.generate([x], p)))
             for x in prompts]
    for t in calls:
        t.start()
    deadline = time.time() + 60
    while eng._counts["decode_steps"] < 5:
        assert time.time() < deadline
        time.sleep(0.001)
    waited = []
    for k in range(12):
        before = eng._counts["decode_steps"]
        if k % 3 == 0:
            after = eng.stats()["decode_steps"]
        elif k % 3 == 1:
            eng.load_weights(weights)  # the same values: tokens stay those of one run
            after = eng._counts["decode_steps"]
        else:
            eng.prompt_logprobs([prompts[0]])
            after = eng._counts["decode_steps"]
        waited.append(after - before)
        time.sleep(0.005)
    for t in calls:
        t.join(60)
        assert not t.is_alive()
    assert max(waited) <= 2, waited  # the step running when it came, at most one more
    assert eng.weight_version == 4 and eng._counts["decode_steps"] >= 299
    assert all(len(o[0][0].token_ids) == 300 for o in outs) and eng.stats()["blocks_in_use"] == 0


def test_stop_tokens_and_default_eos(qwen):
    prompt = ragged_prompts(11, [6])[0]
    free = qwen.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=()))[0][0]
    stop = free.token_ids[3]
    cut = free.token_ids.index(stop) + 1
    out = qwen.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(stop,)))[0][0]
    assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop"
    assert qwen.backend.default_stop_ids == frozenset({0})  # tiny models: <|endoftext|>


def test_forks_survive_preemption_and_recompute():
    """n forks under a cache too small for all of them: every fork still equals HF greedy."""
    engine = make_engine(num_blocks=14, max_num_seqs=8)
    hf = load_model("tiny:qwen3", dtype="float32")
    prompts = ragged_prompts(12, [10, 7])
    out = engine.generate(prompts, SamplingParams(n=4, temperature=0, max_tokens=14, stop_token_ids=()))
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["blocks_in_use"] == 0
    for prompt, samples in zip(prompts, out):
        ref = hf_greedy(hf, prompt, 14, eos=-1)
        assert [s.token_ids for s in samples] == [ref] * 4


def test_failed_step_releases_the_call_and_engine_recovers(qwen, monkeypatch):
    prompt = ragged_prompts(13, [9])[0]
    p = SamplingParams(n=3, temperature=0, max_tokens=6, stop_token_ids=())
    expected = qwen.generate([prompt], p)
    runner = qwen.backend.runner
    real_run, calls = runner.run, []

    def flaky(seqs, is_prefill, *args):
        calls.append(is_prefill)
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return real_run(seqs, is_prefill, *args)

    monkeypatch.setattr(runner, "run", flaky)
    with pytest.raises(RuntimeError, match="device fault"):
        qwen.generate([prompt], p)
    stats = qwen.stats()
    assert stats["blocks_in_use"] == 0 and not qwen.backend.scheduler.has_work()
    assert qwen.generate([prompt], p)[0][0].token_ids == expected[0][0].token_ids


class _InterruptOnce:
    """A lock whose next ``with`` raises ``KeyboardInterrupt`` once (a Ctrl-C landing there)."""

    def __init__(self, lock) -> None:
        self.lock, self.armed = lock, True

    def __enter__(self):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def _queue_from_callers(eng, prompts, params) -> list[list[tuple[int, int]]]:
    """Three threads queue two requests each (``add_request``); per caller, its
    ``(request id, prompt index)`` pairs."""
    toks, plist = eng.validate(prompts, params)
    callers: list[list[tuple[int, int]]] = [[] for _ in range(3)]

    def caller(c):
        callers[c] = [(eng.add_request(toks[i], plist[i]), i) for i in (2 * c, 2 * c + 1)]

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sum(map(len, callers)) == 6
    return callers


def _assert_queued_or_admitted(eng, rids: list[int], *, all_admitted: bool = False) -> None:
    """Each request still in the intake or admitted whole (``_requests`` and the scheduler),
    and no sequence in the scheduler twice."""
    queued = {rid for rid, _, _ in eng._intake}
    held = [s.request_id for s in eng.scheduler.waiting]
    assert not eng.scheduler.running
    assert len(held) == len(set(held)), f"admitted twice: {held}"
    admitted = {r for r in rids if r in eng._requests and r in held}
    lost = [r for r in rids if r not in queued and r not in admitted]
    assert not lost, f"requests neither queued nor admitted: {lost} (intake {sorted(queued)}, " \
                     f"_requests {sorted(eng._requests)}, scheduler {held})"
    if all_admitted:
        assert admitted == set(rids) and not eng._intake


def _finish_interrupted_admission(engine, callers, expected) -> None:
    """The next admission takes the rest (none twice); every caller's ``wait`` gets the tokens
    of an uninterrupted run, with the right number of samples."""
    eng = engine.backend
    with eng._lock:
        eng._admit()  # what the next step does first
    _assert_queued_or_admitted(eng, [r for c in callers for r, _ in c], all_admitted=True)
    results: list = [None] * len(callers)

    def wait(c):
        results[c] = eng.wait([r for r, _ in callers[c]])

    waiters = [threading.Thread(target=wait, args=(c,)) for c in range(len(callers))]
    for t in waiters:
        t.start()
    for t in waiters:
        t.join(60)
        assert not t.is_alive(), "a caller's wait hangs"
    for queued, out in zip(callers, results):
        assert [[s.token_ids for s in samples] for samples in out] == [expected[i] for _, i in queued]
    assert not eng._requests and not eng._intake and not eng.scheduler.has_work()
    assert eng.stats()["blocks_in_use"] == 0


def _interrupted_admission_setup():
    """A fresh engine (an engine the old admission broke stays broken), the greedy tokens of an
    uninterrupted run, and the same six requests queued by three callers."""
    engine = make_engine()
    prompts = ragged_prompts(14, [5, 9, 3, 12, 7, 6])
    params = [SamplingParams(n=1 + i % 2, temperature=0, max_tokens=5, stop_token_ids=())
              for i in range(6)]
    expected = [[s.token_ids for s in out] for out in engine.generate(prompts, params)]
    return engine, expected, _queue_from_callers(engine.backend, prompts, params)


@pytest.mark.parametrize("after_add", [False, True], ids=["before-add", "after-add"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_interrupted_admission_loses_and_repeats_no_request(monkeypatch, k, after_add):
    """A Ctrl-C (``KeyboardInterrupt`` in the thread stepping the engine) while a step admits
    the queued requests of several callers — just before or just after the scheduler takes the
    k-th — leaves each request queued or admitted: the next step admits the rest (none twice)
    and every caller gets its tokens (the old admission lost the rest: a ``KeyError`` or a hang
    in their ``wait``)."""
    engine, expected, callers = _interrupted_admission_setup()
    eng = engine.backend
    real_add, calls = eng.scheduler.add, []

    def add(seq):
        calls.append(seq)
        if len(calls) == k:
            if after_add:
                real_add(seq)
            raise KeyboardInterrupt
        real_add(seq)

    monkeypatch.setattr(eng.scheduler, "add", add)
    with eng._lock, pytest.raises(KeyboardInterrupt):
        eng.step()
    _assert_queued_or_admitted(eng, [r for c in callers for r, _ in c])
    _finish_interrupted_admission(engine, callers, expected)
    assert len(calls) == 6 + (not after_add)  # only the interrupted one was tried again


def test_interrupted_admission_leaving_the_intake(monkeypatch):
    """A Ctrl-C as the admitted requests are taken off the intake: they stay there, admitted,
    and the next admission neither adds them again nor loses them."""
    engine, expected, callers = _interrupted_admission_setup()
    eng = engine.backend
    monkeypatch.setattr(eng, "_intake_lock", _InterruptOnce(eng._intake_lock))
    with eng._lock, pytest.raises(KeyboardInterrupt):
        eng.step()
    rids = [r for c in callers for r, _ in c]
    _assert_queued_or_admitted(eng, rids)
    assert len(eng._intake) == 6 and set(eng._requests) == set(rids)  # admitted, still queued
    _finish_interrupted_admission(engine, callers, expected)


def test_abort_orders_survive_an_interrupted_admission(monkeypatch):
    """A Ctrl-C inside the admission that an abort runs first: the abort orders taken for it
    are not lost (the old code dropped them: the order was never applied), the next step
    applies them, and the aborted requests come back with ``finish_reason="abort"``."""
    engine, _expected, callers = _interrupted_admission_setup()
    eng = engine.backend
    order = engine_module._AbortOrder(None)
    eng._aborts.append(order)
    real_admit = eng._admit
    armed = [True]

    def admit():
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        real_admit()

    monkeypatch.setattr(eng, "_admit", admit)
    with eng._lock, pytest.raises(KeyboardInterrupt):
        eng._apply_aborts()
    assert eng._aborts == [order] and not order.applied.is_set()
    with eng._lock:
        eng._apply_aborts()
    assert order.applied.is_set() and order.count == 6
    for c in callers:
        for samples in eng.wait([r for r, _ in c]):
            assert all(s.finish_reason == "abort" for s in samples)
    assert not eng._requests and not eng._aborts and eng.stats()["blocks_in_use"] == 0

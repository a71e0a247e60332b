"""Async scheduling (``SamplerConfig.async_scheduling``) against the synchronous engine (tiny
models, fp32, CPU — the same code path as on a GPU, where it also overlaps).

Oracle: the same engine built with ``async_scheduling=False``. Every test compares tokens,
log-probs, finish reasons and the engine's counters, and checks that steps were actually
launched ahead (``ahead_steps``) so the async path is the one under test.
"""
from __future__ import annotations

import numpy as np
import pytest
from polynya import SamplingParams
from polynya.models import load_model

from .test_native_engine import make_engine, ragged_prompts

COUNTERS = ("prefill_tokens", "decode_tokens", "cache_hit_tokens", "prefill_steps", "decode_steps",
            "requests", "preemptions", "blocks_in_use", "cache_hit_blocks", "aborted_requests",
            "fca_steps", "scored_tokens", "peak_decode_rows")


def pair(**kw):
    return make_engine(async_scheduling=False, **kw), make_engine(async_scheduling=True, **kw)


def start(engine, prompts, params, at_least: int, steps: int) -> tuple[list[int], int]:
    """Queue the requests and step: the async engine until a step is in flight (at least
    ``at_least`` steps), the synchronous one ``steps + 1`` times (one step further: the step the
    async engine has in flight). Returns the request ids and the async engine's step count."""
    toks, plist = engine.validate(prompts, params)
    rids = [engine.add_request(t, p) for t, p in zip(toks, plist)]
    if not engine.async_scheduling:
        for _ in range(steps + 1):
            engine.step()
        return rids, steps
    steps = 0
    while steps < at_least or engine._inflight is None:
        engine.step()
        steps += 1
        assert steps < 100, "no step was launched ahead"
    return rids, steps


def outputs(result) -> list:
    return [[(s.token_ids, s.logprobs, s.finish_reason) for s in samples] for samples in result]


def same_counters(sync, asyn) -> None:
    """Same counters and the same block-manager state: free-page order (what later requests
    get), prefix-cache keys and reference counts."""
    a, b = sync.stats(), asyn.stats()
    assert {k: a[k] for k in COUNTERS} == {k: b[k] for k in COUNTERS}
    assert a["ahead_steps"] == 0 and b["ahead_steps"] > 0
    bm, bn = sync.block_manager, asyn.block_manager
    assert list(bm.free) == list(bn.free) and bm.key == bn.key and bm.ref_count == bn.ref_count
    assert bm.hash_to_block == bn.hash_to_block


def mixed_params(rng: np.random.Generator, count: int, stops: list[tuple[int, ...]]) -> list[SamplingParams]:
    """Seeded and unseeded, greedy and sampled, filters, forks, ragged lengths, stop tokens."""
    out = []
    for i in range(count):
        kind = i % 4
        out.append(SamplingParams(
            n=int(rng.integers(1, 5)), temperature=0.0 if kind == 3 else float(rng.uniform(0.7, 1.2)),
            top_k=50 if kind == 1 else -1, top_p=0.9 if kind == 2 else 1.0,
            max_tokens=int(rng.integers(3, 24)), seed=None if kind == 2 else int(rng.integers(1 << 30)),
            stop_token_ids=stops[i], logprobs=True))
    return out


def stops_hit_at_different_steps(engine, prompts: list[list[int]], seed: int) -> list[tuple[int, ...]]:
    """Per prompt, a stop token its greedy continuation emits at a different step each."""
    free = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=()))
    return [(samples[0].token_ids[(2 * i + seed) % 20],) for i, samples in enumerate(free)]


def mixed_run(sync, asyn, seed: int, count: int, longest: int):
    """``count`` ragged prompts with ``mixed_params`` through both engines; outputs equal."""
    rng = np.random.default_rng(seed)
    prompts = ragged_prompts(100 + seed, rng.integers(3, longest, size=count).tolist())
    params = mixed_params(rng, count, stops_hit_at_different_steps(make_engine(), prompts, seed))
    want, got = sync.generate(prompts, params), asyn.generate(prompts, params)
    assert outputs(got) == outputs(want)
    return prompts, params, got


@pytest.mark.parametrize("seed", [0, 1])
def test_async_equals_sync_on_a_mixed_batch(seed):
    """Ragged prompts, n > 1 forks, stop tokens hit at different steps, max_tokens reached,
    greedy / top-k / top-p / unseeded rows: every output and counter equal."""
    sync, asyn = pair(max_num_seqs=16)
    prompts, params, got = mixed_run(sync, asyn, seed, 7, 40)
    reasons = {s.finish_reason for samples in got for s in samples}
    assert reasons == {"stop", "length"}, reasons
    stats = asyn.stats()
    assert stats["ahead_steps"] >= stats["decode_steps"] // 2  # the async path did the work
    same_counters(sync.backend, asyn.backend)
    # the engines stay in step: a second call (prefix cache hits, fresh master-seed draws) too
    assert outputs(asyn.generate(prompts[:4], params[:4])) == outputs(sync.generate(prompts[:4], params[:4]))
    same_counters(sync.backend, asyn.backend)


def test_async_equals_sync_under_preemption():
    """A cache too small for the batch: preemption, recompute and forks, same results."""
    sync, asyn = pair(num_blocks=14, max_num_seqs=8)
    prompts = ragged_prompts(12, [10, 7, 5])
    params = [SamplingParams(n=4, temperature=1.0, max_tokens=14, seed=5, stop_token_ids=(), logprobs=True),
              SamplingParams(n=3, temperature=0, max_tokens=11, stop_token_ids=(), logprobs=True),
              SamplingParams(n=2, temperature=0.8, top_k=20, max_tokens=9, seed=6, logprobs=True)]
    want, got = sync.generate(prompts, params), asyn.generate(prompts, params)
    assert outputs(got) == outputs(want)
    assert sync.stats()["preemptions"] > 0
    same_counters(sync.backend, asyn.backend)


def test_abort_in_flight_lands_after_that_step():
    """``abort`` while a step is on the device books that step first: the result equals the
    synchronous engine aborting one step later, for the aborted request and the others."""
    sync, asyn = pair()
    prompts = ragged_prompts(21, [7, 13, 10])
    params = [SamplingParams(n=2, temperature=0.9, max_tokens=14, seed=11, logprobs=True, stop_token_ids=()),
              SamplingParams(n=3, temperature=1.0, top_k=50, max_tokens=14, seed=12, logprobs=True,
                             stop_token_ids=()),
              SamplingParams(temperature=0.8, max_tokens=14, seed=13, logprobs=True, stop_token_ids=())]
    results, steps = [], 0
    for engine in (asyn.backend, sync.backend):
        rids, steps = start(engine, prompts, params, 5, steps)
        assert engine.abort([rids[1]]) == 1
        assert engine._inflight is None
        results.append(outputs(engine.wait(rids)))
    assert results[1] == results[0]
    assert {s[2] for s in results[0][1]} == {"abort"} and all(len(s[0]) == steps + 1 for s in results[0][1])
    same_counters(sync.backend, asyn.backend)


def test_request_added_while_a_step_is_in_flight():
    """A request queued between two ``step`` calls joins after the step in flight: equal to the
    synchronous engine receiving it one step later."""
    sync, asyn = pair()
    first = ragged_prompts(31, [9, 14])
    late = ragged_prompts(32, [6])
    p = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3, stop_token_ids=(), logprobs=True)
    results, steps = [], 0
    for engine in (asyn.backend, sync.backend):
        rids, steps = start(engine, first, p, 3, steps)
        (tok,), (q,) = engine.validate(late, p)
        rids.append(engine.add_request(tok, q))
        results.append(outputs(engine.wait(rids)))
    assert results[1] == results[0]
    same_counters(sync.backend, asyn.backend)


def test_scoring_weight_load_and_sleep_between_steps():
    """``prompt_logprobs`` while a step is in flight, then a weight load and sleep / wake
    between generates: the same answers as the synchronous engine, in the same order."""
    sync, asyn = pair()
    new = dict(load_model("tiny:qwen3", dtype="float32", seed=1).named_parameters())
    prompts = ragged_prompts(41, [8, 15])
    p = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=8, stop_token_ids=(), logprobs=True)
    results, steps = [], 0
    for engine in (asyn.backend, sync.backend):
        rids, steps = start(engine, prompts, p, 3, steps)
        scored = engine.prompt_logprobs(prompts, top_k=3)
        assert engine._inflight is None
        first = outputs(engine.wait(rids))
        engine.load_weights(new)
        second = outputs(engine.generate(prompts, p))
        engine.sleep(level=1)
        engine.wake()
        third = outputs(engine.generate(prompts, p))
        results.append((first, second, third, [(s.logprobs.tolist(), s.top_ids.tolist()) for s in scored]))
    assert results[1] == results[0]
    assert results[0][1] != results[0][0]  # the new weights answer differently
    same_counters(sync.backend, asyn.backend)


def test_async_scheduling_with_llama_and_greedy_forks():
    """Another family, greedy forks that stop on the default EOS at their own steps."""
    sync, asyn = pair(model="tiny:llama", max_num_seqs=12)
    prompts = ragged_prompts(51, [4, 19, 11, 27])
    p = SamplingParams(n=3, temperature=1.3, max_tokens=30, seed=9, logprobs=True)
    want, got = sync.generate(prompts, p), asyn.generate(prompts, p)
    assert outputs(got) == outputs(want)
    same_counters(sync.backend, asyn.backend)


def test_rows_stop_at_the_model_length():
    """Rows that reach ``max_model_len`` (not ``max_tokens``) leave the step launched ahead."""
    sync, asyn = pair(max_model_len=22)
    prompts = ragged_prompts(61, [5, 12, 17, 9])
    p = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=4, stop_token_ids=(), logprobs=True)
    want, got = sync.generate(prompts, p), asyn.generate(prompts, p)
    assert outputs(got) == outputs(want)
    assert [len(s.token_ids) for samples in got for s in samples] == [17, 17, 10, 10, 5, 5, 13, 13]
    same_counters(sync.backend, asyn.backend)


@pytest.mark.parametrize("seed", [2, 3])
def test_continuous_batching_with_sequences_waiting(seed):
    """More rows than ``max_num_seqs``: sequences wait while the batch decodes, and join as
    rows stop (stop tokens, ``max_tokens``) — steps are launched ahead while nothing would
    admit them, and the prefills happen at the same steps as without async scheduling."""
    sync, asyn = pair(max_num_seqs=6, block_size=8)
    mixed_run(sync, asyn, seed, 9, 30)
    same_counters(sync.backend, asyn.backend)
    stats = asyn.stats()
    assert stats["prefill_steps"] > 3 and stats["ahead_steps"] >= stats["decode_steps"] // 3, stats


@pytest.mark.parametrize("num_blocks, m", [(6, 6), (6, 10), (7, 10)])
def test_waiting_sequence_admitted_by_a_page_keyed_this_step(num_blocks, m):
    """A waiting prompt that fits only once the running request's newest page is in the prefix
    cache (its prompt continues that request's greedy answer; a cache of a few pages): the
    step launched ahead must see the page keyed exactly when booking would key it."""
    first = ragged_prompts(7, [10])[0]
    greedy = make_engine().generate([first], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=()))
    prompts = [first, first + greedy[0][0].token_ids[:m]]
    params = [SamplingParams(n=2, temperature=0, max_tokens=12, stop_token_ids=()),
              SamplingParams(temperature=0, max_tokens=6, stop_token_ids=())]
    sync, asyn = pair(num_blocks=num_blocks, max_num_seqs=4)
    want, got = sync.generate(prompts, params), asyn.generate(prompts, params)
    assert outputs(got) == outputs(want)
    assert sync.stats()["cache_hit_tokens"] > 0
    same_counters(sync.backend, asyn.backend)


def stop_at(engine, prompt: list[int], step: int) -> tuple[int, ...]:
    """A stop token the prompt's greedy continuation emits first at ``step`` (0-based)."""
    toks = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=step + 1,
                                                    stop_token_ids=()))[0][0].token_ids
    assert toks[step] not in toks[:step], "pick another prompt: the token comes earlier"
    return (toks[step],)


@pytest.mark.parametrize("mode", ["same_shape", "shape_changes", "off"])
def test_rows_that_stop_leave_the_step_launched_before_their_token_was_back(mode, monkeypatch):
    """Steps launched before the previous step's tokens are back (``early_steps``) carry the
    rows that stopped in that step. ``same_shape``: the step's shape does not depend on those
    rows (as when a CUDA-graph bucket holds both; forced here), their extra tokens are dropped
    (``ahead_rows_dropped``) and the step is booked for the others. ``shape_changes`` (the CPU:
    every row counts): the step is dropped whole and launched again (``early_steps_dropped``).
    ``off``: ``launch_before_readback`` off. Every way, outputs, counters, free pages and
    prefix-cache keys equal the synchronous engine's."""
    sync, asyn = pair(max_num_seqs=16)
    if mode == "same_shape":
        monkeypatch.setattr(asyn.backend.runner, "decode_rows", lambda rows: 16)
    asyn.backend.launch_before_readback = mode != "off"
    prompts = ragged_prompts(72, [6, 11, 9])
    probe = make_engine()
    params = [SamplingParams(n=3, temperature=0, max_tokens=20, stop_token_ids=stop_at(probe, prompts[0], 4)),
              SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stop_at(probe, prompts[1], 10)),
              SamplingParams(n=2, temperature=1.0 if mode != "same_shape" else 0, max_tokens=13,
                             seed=3, logprobs=True, stop_token_ids=())]
    want, got = sync.generate(prompts, params), asyn.generate(prompts, params)
    if mode == "same_shape":  # the CPU's GEMMs round by batch size: the forced shape is not
        # real here, so greedy rows (the same tokens) and log-probs within rounding
        assert [[s.token_ids for s in o] for o in got] == [[s.token_ids for s in o] for o in want]
        np.testing.assert_allclose(got[2][0].logprobs, want[2][0].logprobs, rtol=1e-5, atol=1e-6)
    else:
        assert outputs(got) == outputs(want)
    assert [len(s.token_ids) for s in got[0]] == [5, 5, 5] and len(got[1][0].token_ids) == 11
    same_counters(sync.backend, asyn.backend)
    stats = asyn.stats()
    if mode == "off":
        assert stats["early_steps"] == 0 and stats["ahead_rows_dropped"] == 0
        return
    assert stats["early_steps"] > 0 and stats["ahead_rows_dropped"] == 4, stats
    # the two stop steps: kept with the rows dropped, or dropped whole and launched again
    assert stats["early_steps_dropped"] == (0 if mode == "same_shape" else 2), stats


def test_a_step_launched_early_whose_rows_all_stopped_is_dropped():
    """The last row stops while the step after it is on the device: that step is dropped
    (counters as the synchronous engine's); the engine then loads weights, sleeps, wakes and
    serves the next call exactly as the synchronous engine does."""
    sync, asyn = pair()
    prompt = ragged_prompts(81, [7])
    p = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stop_at(make_engine(), prompt[0], 7))
    want, got = sync.generate(prompt, p), asyn.generate(prompt, p)
    assert outputs(got) == outputs(want) and len(got[0][0].token_ids) == 8
    stats = asyn.stats()
    assert stats["ahead_rows_dropped"] == 1 and stats["early_steps_dropped"] == 1, stats
    assert asyn.backend._inflight is None and asyn.backend._readback.pending == 0
    same_counters(sync.backend, asyn.backend)
    new = dict(load_model("tiny:qwen3", dtype="float32", seed=2).named_parameters())
    for engine in (sync, asyn):
        engine.backend.load_weights(new)
        engine.backend.sleep(level=1)
        engine.backend.wake()
    q = SamplingParams(n=2, temperature=1.0, max_tokens=9, seed=4, stop_token_ids=(), logprobs=True)
    assert outputs(asyn.generate(prompt, q)) == outputs(sync.generate(prompt, q))
    same_counters(sync.backend, asyn.backend)


def test_abort_and_scoring_while_a_step_with_dropped_rows_is_in_flight(monkeypatch):
    """A step launched early that kept its other rows after some stopped (forced same shape,
    greedy rows: the CPU rounds by batch size) is in flight: ``abort`` books it first (its
    live rows only) and ``prompt_logprobs`` sees the engine between steps; tokens and block
    manager as the synchronous engine aborting one step later."""
    sync, asyn = pair(max_num_seqs=16)
    monkeypatch.setattr(asyn.backend.runner, "decode_rows", lambda rows: 16)
    prompts = ragged_prompts(72, [6, 11, 9])
    probe = make_engine()
    params = [SamplingParams(n=3, temperature=0, max_tokens=20, stop_token_ids=stop_at(probe, prompts[0], 4)),
              SamplingParams(temperature=0, max_tokens=20, stop_token_ids=()),
              SamplingParams(n=2, temperature=0, max_tokens=20, stop_token_ids=())]
    eng = asyn.backend
    toks, plist = eng.validate(prompts, params)
    rids = [eng.add_request(t, p) for t, p in zip(toks, plist)]
    steps = 0
    while eng._inflight is None or eng._inflight.live is None:
        eng.step()
        steps += 1
        assert steps < 40, "no early step kept rows past a stop"
    scored = eng.prompt_logprobs(prompts[1:], top_k=2)
    assert eng._inflight is None and eng.abort([rids[1]]) == 1
    got = [[s.token_ids for s in o] for o in eng.wait(rids)]
    bs = sync.backend
    toks, plist = bs.validate(prompts, params)
    rids = [bs.add_request(t, p) for t, p in zip(toks, plist)]
    for _ in range(steps + 1):
        bs.step()
    want_scored = bs.prompt_logprobs(prompts[1:], top_k=2)
    assert bs.abort([rids[1]]) == 1
    want = [[s.token_ids for s in o] for o in bs.wait(rids)]
    assert got == want and len(got[1][0]) == steps + 1
    assert [s.top_ids.tolist() for s in scored] == [s.top_ids.tolist() for s in want_scored]
    same_counters(bs, eng)

"""``SamplingParams`` objects reused and changed by the caller (tiny:qwen3, fp32, CPU).

A request runs on a private copy of its params taken when it is checked, so changing the
caller's object changes neither a request already queued nor the settings the engine keeps per
row between steps (which it compares by value): each call samples with the values it was given.
Oracles: HF greedy, and the same request on a fresh engine.
"""
from __future__ import annotations

import pytest
from polynya import SamplingParams
from polynya.engines.sample.native import engine as engine_module
from polynya.models import load_model

from .test_failed_steps import greedy, queue
from .test_native_engine import make_engine, ragged_prompts


@pytest.fixture(scope="module")
def hf_qwen():
    return load_model("tiny:qwen3", dtype="float32")


def test_a_reused_params_object_samples_with_its_new_values(hf_qwen):
    """Temperature 1 then 0 on one object: the second call is greedy (the old engine kept the
    first call's per-row settings, keyed by the object's identity, while reading the new
    temperature for the draws: token 0 every step); top-k 1 then is greedy too."""
    engine = make_engine()
    prompt = ragged_prompts(41, [7])[0]
    ref = greedy(hf_qwen, prompt, 6)
    p = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=(), seed=3)
    first = engine.generate([prompt], p)[0][0].token_ids
    assert first != ref  # sampled, so the next call has something to change
    p.temperature = 0.0
    assert engine.generate([prompt], p)[0][0].token_ids == ref
    p.temperature, p.top_k, p.seed = 1.0, 1, None
    for _ in range(3):
        assert engine.generate([prompt], p)[0][0].token_ids == ref


def test_changing_the_object_leaves_a_queued_request_alone():
    """A request queued, then its caller's object changed before a step ran it: it samples
    with the values it was queued with (seeded: the same tokens as on a fresh engine)."""
    engine = make_engine()
    eng = engine.backend
    prompts = ragged_prompts(42, [9, 6])
    p = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=8, stop_token_ids=(), seed=4,
                       logprobs=True)
    want = make_engine().generate(prompts, p)
    rids = queue(eng, prompts, p)
    p.temperature, p.top_p, p.max_tokens, p.logprobs = 0.0, 1.0, 2, False
    got = eng.wait(rids)
    assert [[(s.token_ids, s.logprobs) for s in o] for o in got] == \
        [[(s.token_ids, s.logprobs) for s in o] for o in want]


def test_an_object_changed_to_a_bad_value_is_refused():
    """The copy is checked as it is taken: a value the constructor refuses is refused by
    ``generate`` too, naming the request, and nothing is queued."""
    engine = make_engine()
    prompts = ragged_prompts(43, [5, 8])
    good = SamplingParams(max_tokens=3)
    bad = SamplingParams(max_tokens=3)
    bad.temperature = -1.0
    with pytest.raises(ValueError, match=r"params\[1\].*temperature"):
        engine.generate(prompts, [good, bad])
    bad.temperature, bad.top_p = 1.0, 0.0
    with pytest.raises(ValueError, match=r"params\[1\].*top_p"):
        engine.generate(prompts, [good, bad])
    assert engine.stats()["requests"] == 0 and not engine.backend.scheduler.has_work()


def test_row_settings_are_rebuilt_only_when_their_values_change(monkeypatch):
    """The per-row settings are built once for a run of the same rows, and reused for the next
    call whose params are another object with the same values; a changed value rebuilds them."""
    builds = []
    real = engine_module.SamplingTensors.build

    def build(params, *args, **kwargs):
        builds.append([p.temperature for p in params])
        return real(params, *args, **kwargs)

    monkeypatch.setattr(engine_module.SamplingTensors, "build", staticmethod(build))
    engine = make_engine()
    prompt = ragged_prompts(44, [6])[0]
    engine.generate([prompt], SamplingParams(n=3, temperature=0.8, max_tokens=9, stop_token_ids=(), seed=1))
    assert builds == [[0.8] * 3]  # one prefill and eight decode steps of the same rows
    engine.generate([prompt], SamplingParams(n=3, temperature=0.8, max_tokens=9, stop_token_ids=(), seed=1))
    assert len(builds) == 1
    engine.generate([prompt], SamplingParams(n=3, temperature=0.7, max_tokens=9, stop_token_ids=(), seed=2))
    assert builds[1:] == [[0.7] * 3]


def test_generate_async_takes_the_values_of_its_call(hf_qwen):
    """A caller that changes its params object after calling ``generate_async`` (before the
    worker thread gets to it: held here until the change is made) gets the call's values."""
    import asyncio
    import threading

    engine = make_engine()
    prompt = ragged_prompts(43, [6])[0]
    params = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=())
    changed, real = threading.Event(), engine.generate

    def held(*args, **kw):
        assert changed.wait(30)
        return real(*args, **kw)
    engine.generate = held

    async def call_then_change():
        task = asyncio.ensure_future(engine.generate_async([prompt], params))
        await asyncio.sleep(0)  # the call has started
        params.max_tokens, params.temperature = 2, 1.0
        changed.set()
        return await task

    out = asyncio.run(call_then_change())[0][0]
    assert out.token_ids == greedy(hf_qwen, prompt, 5) and out.finish_reason == "length"

"""The compiled prefill (``SamplerConfig.compile_prefill``, Inductor on CPU) equals the eager
one: greedy tokens and their log-probs over generates with ragged prompts, prompts that reuse
cached pages (a prefill over a cached prefix) and new prompt lengths on every call, and prompt
log-probs (scoring passes run the same regions), for a family with q/k norms (Qwen3), one
without (Llama) and windowed ones (Mistral's window from the config, Qwen2's from the module).
One compile per region serves every prompt length; decode steps never take the regions, scoring
passes do; new weights reach them; an unverified family or transformers release prefills eagerly
and says why; a failed compile (also after a layer's cache write) prefills eagerly from then on
with a warning and the same numbers, while out-of-memory and the layer's own errors are raised
and leave the regions on."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.engines.sample.native import compiled_prefill
from polynya.models import TINY_SLIDING_WINDOW
from torch._dynamo.exc import TorchDynamoException

NEW = 5


def make_engine(family: str, compile_prefill: bool) -> SamplingEngine:
    return SamplingEngine(SamplerConfig(f"tiny:{family}", dtype="float32", device="cpu", block_size=4,
                                        num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64,
                                        compile_decode=False, compile_prefill=compile_prefill))


def calls(seed: int) -> list[tuple[list[list[int]], SamplingParams]]:
    """Three generates with new prompt lengths each: ragged prompts past the window, then
    prompts behind the first call's system prompt (their prefill reads cached pages), then one
    long prompt over two prefill steps (``max_num_batched_tokens``)."""
    g = np.random.default_rng(seed)
    system = g.integers(4, 500, size=3 * TINY_SLIDING_WINDOW + 1).tolist()
    params = SamplingParams(n=2, temperature=0, max_tokens=NEW, logprobs=True, stop_token_ids=())

    def prompts(*lengths: int, prefix: list[int] = ()) -> list[list[int]]:
        return [list(prefix) + g.integers(4, 500, size=n).tolist() for n in lengths]

    return [(prompts(3, 11, prefix=system) + prompts(2 * TINY_SLIDING_WINDOW + 5), params),
            (prompts(6, 17, prefix=system), params),
            (prompts(90), SamplingParams(temperature=0, max_tokens=NEW, logprobs=True,
                                         stop_token_ids=()))]


def run(engine: SamplingEngine, seed: int = 0):
    return [engine.generate(prompts, params) for prompts, params in calls(seed)]


def assert_same_samples(got, want) -> None:
    for call_got, call_want in zip(got, want, strict=True):
        for req_got, req_want in zip(call_got, call_want, strict=True):
            for a, b in zip(req_got, req_want, strict=True):
                assert a.token_ids == b.token_ids
                np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral", "qwen2-window"])
def test_compiled_prefill_equals_eager(family):
    eager, compiled = make_engine(family, False), make_engine(family, True)
    assert_same_samples(run(compiled), run(eager))
    stats = compiled.stats()
    assert stats["prefill_compile_reason"] is None
    assert stats["prefill_compiles"] == 2  # before + after region, every prompt length
    assert stats["prefill_compile_s"] > 0
    assert stats["cache_hit_tokens"] > 0  # the second call's prefill read cached pages
    assert eager.stats()["prefill_compiles"] == 0
    assert eager.stats()["prefill_compile_reason"] == "compile_prefill is off"
    seqs = calls(3)[0][0]
    for got, want in zip(compiled.prompt_logprobs(seqs, top_k=3, temperature=0.7),
                         eager.prompt_logprobs(seqs, top_k=3, temperature=0.7), strict=True):
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-4)
        assert torch.equal(got.top_ids, want.top_ids)
    assert compiled.stats()["prefill_compiles"] == 2  # scoring's new lengths: no recompile


def region_calls(monkeypatch) -> list[int]:
    """The token count of every call that runs the compiled regions, from now on."""
    seen = []
    real = compiled_prefill.run_regions

    def counting(regions, layer, hidden, *args, **kwargs):
        seen.append(hidden.shape[1])
        return real(regions, layer, hidden, *args, **kwargs)

    monkeypatch.setattr(compiled_prefill, "run_regions", counting)
    return seen


def test_only_prefill_calls_take_the_regions(monkeypatch):
    engine = make_engine("qwen3", True)
    seen = region_calls(monkeypatch)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=()))
    stats = engine.stats()
    layers = engine.backend.runner.num_layers
    assert stats["prefill_steps"] == 1 and stats["decode_steps"] == NEW - 1
    assert seen == [8] * layers  # one packed prefill row of 5 + 3 tokens per layer, no decode row


def test_unverified_family_prefills_eagerly_and_says_why():
    engine, eager = make_engine("gemma2", True), make_engine("gemma2", False)
    assert_same_samples(run(engine), run(eager))
    stats = engine.stats()
    assert stats["prefill_compiles"] == 0
    assert "Gemma2DecoderLayer is not verified" in stats["prefill_compile_reason"]


def test_compile_failure_prefills_eagerly_with_a_warning(monkeypatch):
    engine, eager = make_engine("qwen3", True), make_engine("qwen3", False)

    def broken(*args, **kwargs):
        raise TorchDynamoException("inductor failed\nlong trace")

    monkeypatch.setattr(compiled_prefill, "run_regions", broken)
    with pytest.warns(RuntimeWarning, match="prefill's layers cannot be compiled .*inductor failed"):
        got = run(engine)
    assert_same_samples(got, run(eager))
    assert engine.stats()["prefill_compile_reason"] == "TorchDynamoException: inductor failed"
    assert engine.backend.runner.prefill_compiled.error is not None


def test_a_failure_after_a_layers_cache_write_reruns_it_eagerly(monkeypatch):
    """The second layer's after-region fails once its attention has written the cache: that
    layer runs again eagerly (same cache values), every later call eagerly, same numbers."""
    real = compiled_prefill.layer_regions

    def failing_second_after(*args, **kwargs):
        regions, calls = real(*args, **kwargs), []

        def after(layer, residual, out):
            calls.append(layer)
            if len(calls) == 2:
                raise TorchDynamoException("after-region failed")
            return regions.after(layer, residual, out)

        return dataclasses.replace(regions, after=after)

    monkeypatch.setattr(compiled_prefill, "layer_regions", failing_second_after)
    engine, eager = make_engine("qwen3", True), make_engine("qwen3", False)
    with pytest.warns(RuntimeWarning, match="after-region failed"):
        got = run(engine)
    assert_same_samples(got, run(eager))


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   ValueError("the attention refused its inputs")])
def test_other_errors_are_raised_and_the_regions_stay_on(monkeypatch, error):
    """Out of memory, or an error of the layer's own (its attention's checks), is not a compile
    failure: it reaches the caller as the eager layer would raise it, and later prefills still
    run compiled, with the same numbers."""
    engine, eager = make_engine("qwen3", True), make_engine("qwen3", False)
    run(engine)  # compiled once
    real = compiled_prefill.run_regions

    def raising(*args, **kwargs):
        raise error

    monkeypatch.setattr(compiled_prefill, "run_regions", raising)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "cannot be compiled" warning
        with pytest.raises(type(error), match=str(error)):
            engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=2))
    monkeypatch.setattr(compiled_prefill, "run_regions", real)
    assert engine.stats()["prefill_compile_reason"] is None
    assert_same_samples(run(engine, seed=1), run(eager, seed=1))
    assert engine.stats()["prefill_compiles"] == 2


def test_scoring_passes_take_the_regions(monkeypatch):
    engine = make_engine("qwen3", True)
    seen = region_calls(monkeypatch)
    engine.prompt_logprobs([[5, 6, 7], [8, 9, 10, 11, 12]], top_k=1)
    assert seen == [8] * engine.backend.runner.num_layers  # one packed pass, every layer


def test_unverified_transformers_prefills_eagerly_and_says_why(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    engine = make_engine("qwen3", True)
    run(engine)
    stats = engine.stats()
    assert stats["prefill_compiles"] == 0
    assert "transformers 5.25.0 is not verified" in stats["prefill_compile_reason"]


def test_config_defaults_and_validation():
    assert SamplerConfig("tiny:qwen3").prefill_compiled("cuda")
    assert not SamplerConfig("tiny:qwen3").prefill_compiled("cpu")
    assert not SamplerConfig("tiny:qwen3", compile_decode=False).prefill_compiled("cuda")
    assert SamplerConfig("tiny:qwen3", compile_prefill=True).prefill_compiled("cpu")
    assert not SamplerConfig("tiny:qwen3", compile_prefill=False).prefill_compiled("cuda")
    with pytest.raises(ValueError, match="compile_prefill must be a bool or None"):
        SamplerConfig("tiny:qwen3", compile_prefill="yes")


def test_new_weights_reach_the_compiled_regions():
    """The regions take the layers' parameters as graph inputs: weights loaded in place (a
    sync), and weights moved off and back (a level-2 sleep), change the prefill's numbers as
    they change the eager one's — never a stale compiled constant."""
    from polynya.models import load_model

    compiled, eager = make_engine("qwen3", True), make_engine("qwen3", False)
    prompts = calls(4)[0][0]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=True, stop_token_ids=())
    before = compiled.generate(prompts, params)
    new = dict(load_model("tiny:qwen3", dtype=torch.float32, seed=11).named_parameters())
    for engine in (compiled, eager):
        engine.load_weights(new)
    after, want = compiled.generate(prompts, params), eager.generate(prompts, params)
    assert_same_samples([after], [want])
    assert [o[0].logprobs for o in after] != [o[0].logprobs for o in before]
    compiled.sleep(level=2)  # the weights leave the device and come back (the CPU: in place)
    compiled.wake()
    assert_same_samples([compiled.generate(prompts, params)], [want])
    assert compiled.stats()["prefill_compiles"] == 2

"""``compile_layers`` on the engines: validated (a bool; not with ``fused_kernels``, not under
ZeRO-3), applied where each engine loads its model, and a ZeRO-2 training step with gradient
checkpointing through the compiled layers gives the eager step's loss, gradient norm and updated
weights, as the log-prob engine gives the eager log-probs (the ``aot_eager`` backend: the
graphs without code generation; Inductor's numbers are checked in ``tests/core``)."""
from __future__ import annotations

import functools

import pytest
import torch
from polynya import compiled_layers
from polynya.config.logprob import LogProbConfig
from polynya.config.train import TrainConfig
from polynya.engines.logprob import LogProbEngine
from polynya.engines.train import TrainingEngine

from tests.core.test_compiled_layers import _count_regions

from .common import full_weights, make_batch, train_config

MODEL = "tiny:qwen3"


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled_layers, "compile_layers",
                        functools.partial(compiled_layers.compile_layers, backend="aot_eager"))


@pytest.mark.parametrize(("kw", "match"), [
    (dict(compile_layers="yes"), "compile_layers must be a bool"),
    (dict(compile_layers=1), "compile_layers must be a bool"),
    (dict(compile_layers=True, fused_kernels=True), "pick one"),
    (dict(compile_layers=True, zero_stage=3), "ZeRO-3"),
])
def test_compile_layers_is_checked(kw, match):
    with pytest.raises(ValueError, match=f"TrainConfig.*{match}|{match}"):
        TrainConfig(MODEL, **kw)
    with pytest.raises(ValueError, match=match):
        LogProbConfig(MODEL, **kw)
    assert TrainConfig(MODEL).compile_layers is False and LogProbConfig(MODEL).compile_layers is False


def test_an_unsupported_family_is_refused_at_construction():
    with pytest.raises(ValueError, match="is not verified"):
        LogProbEngine(LogProbConfig("tiny:gemma2", dtype="float32", compile_layers=True))


def test_logprob_engine_compiles_only_when_asked(aot_eager):
    plain = LogProbEngine(LogProbConfig(MODEL, dtype="float32"))
    compiled = LogProbEngine(LogProbConfig(MODEL, dtype="float32", compile_layers=True))
    assert compiled_layers.compiled_modules(plain.module) == []
    n = compiled.module.config.num_hidden_layers
    assert compiled_layers.compiled_modules(compiled.module) == [f"model.layers.{i}" for i in range(n)]
    for seed in (5, 6):  # new lengths: the dynamic graph serves both
        batch = make_batch(seed)
        a, b = plain.compute_logprobs(batch, entropy=True), compiled.compute_logprobs(batch, entropy=True)
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.entropy, a.entropy, atol=1e-5, rtol=0)


def test_zero2_checkpointed_step_equals_eager(aot_eager):
    batch = make_batch(11, old=True)
    out = []
    for compile_ in (False, True):
        engine = TrainingEngine(train_config(2, gradient_checkpointing=True, compile_layers=compile_,
                                             micro_batch_tokens=1 << 12))
        assert bool(compiled_layers.compiled_modules(engine.module)) == compile_
        calls = []
        if compile_:
            _count_regions(engine.module, calls)
        m = engine.forward_backward(batch)
        assert calls == ["before", "after"] * 2 * int(m["micro_batches"]) * compile_  # fwd + recompute
        s = engine.step()
        m2 = engine.forward_backward(make_batch(12, old=True))  # a second step, other lengths
        s2 = engine.step()
        out.append((m["loss"], s["grad_norm"], m2["loss"], s2["grad_norm"], full_weights(engine.module)))
    (l0, g0, k0, h0, w0), (l1, g1, k1, h1, w1) = out
    assert l1 == pytest.approx(l0, rel=1e-5) and g1 == pytest.approx(g0, rel=1e-4)
    assert k1 == pytest.approx(k0, rel=1e-5) and h1 == pytest.approx(h0, rel=1e-4)
    before = full_weights(TrainingEngine(train_config(2)).module)
    assert any(not torch.equal(w1[n], before[n]) for n in w1)  # the steps changed the weights
    for name in w0:
        torch.testing.assert_close(w1[name], w0[name], rtol=1e-5, atol=1e-6)

"""``compile_layers`` on the engines, on a GPU (Inductor, DeepSpeed ZeRO-2): two training steps
with gradient checkpointing through the compiled layers give the eager engine's losses,
gradient norms and updated weights (fp32, 1e-4), and the log-prob engine the eager log-probs and
entropy, on ragged batches of new lengths each call."""
from __future__ import annotations

import pytest
import torch
from polynya.compiled_layers import compiled_modules
from polynya.config.logprob import LogProbConfig
from polynya.engines.logprob import LogProbEngine
from polynya.engines.train import TrainingEngine

from .common import full_weights, make_batch, train_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_zero2_checkpointed_steps_equal_eager_on_gpu():
    out = []
    for compile_ in (False, True):
        engine = TrainingEngine(train_config(2, gradient_checkpointing=True, compile_layers=compile_,
                                             micro_batch_tokens=1 << 12, device="cuda"))
        assert bool(compiled_modules(engine.module)) == compile_
        rows = []
        for seed in (11, 12):
            m = engine.forward_backward(make_batch(seed, old=True))
            s = engine.step()
            rows += [m["loss"], s["grad_norm"]]
        out.append((rows, full_weights(engine.module)))
    (r0, w0), (r1, w1) = out
    assert r1 == pytest.approx(r0, rel=1e-4)
    for name in w0:
        torch.testing.assert_close(w1[name], w0[name], rtol=1e-4, atol=1e-5)


def test_logprob_engine_compiled_equals_eager_on_gpu():
    plain = LogProbEngine(LogProbConfig("tiny:qwen3", dtype="float32", device="cuda"))
    compiled = LogProbEngine(LogProbConfig("tiny:qwen3", dtype="float32", device="cuda",
                                           compile_layers=True))
    assert compiled_modules(compiled.module)
    for seed in (5, 6):
        batch = make_batch(seed)
        a, b = plain.compute_logprobs(batch, entropy=True), compiled.compute_logprobs(batch, entropy=True)
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(b.entropy, a.entropy, atol=1e-4, rtol=0)

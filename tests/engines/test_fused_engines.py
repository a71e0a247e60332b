"""``fused_kernels`` on the engines: validated, applied where each engine loads its model, and
(under ``TRITON_INTERPRET=1`` in a child process, so the Triton kernels run on CPU tensors) a
ZeRO-3 training step with gradient checkpointing gives the unfused step's loss, gradient norm
and updated weights, the kernels (RMSNorm and RoPE) running inside ZeRO-3's gathered forward,
the checkpoint recompute and the backward."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from polynya.config.logprob import LogProbConfig
from polynya.config.train import TrainConfig
from polynya.engines.logprob import LogProbEngine
from polynya.fused import fused_modules

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from triton_interp import check_under_interpreter  # noqa: E402

MODEL = "tiny:qwen3"


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_fused_kernels_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="TrainConfig.fused_kernels must be a bool"):
        TrainConfig(MODEL, fused_kernels=bad)
    with pytest.raises(ValueError, match="LogProbConfig.fused_kernels must be a bool"):
        LogProbConfig(MODEL, fused_kernels=bad)
    assert TrainConfig(MODEL).fused_kernels is False and LogProbConfig(MODEL).fused_kernels is False


def test_logprob_engine_fuses_its_model_only_when_asked():
    plain = LogProbEngine(LogProbConfig(MODEL, dtype="float32"))
    fused = LogProbEngine(LogProbConfig(MODEL, dtype="float32", fused_kernels=True))
    assert fused_modules(plain.module) == []
    names = fused_modules(fused.module)
    assert len(names) == 1 + 5 * 2  # final norm; per layer 4 norms + the attention (RoPE)
    assert "model.layers.1.self_attn.k_norm" in names and "model.layers.1.self_attn" in names
    from .common import make_batch

    batch = make_batch(5)
    assert torch.equal(plain.compute_logprobs(batch).logprobs,  # CPU: HF's forward either way
                       fused.compute_logprobs(batch).logprobs)


def check_zero3_step() -> None:
    from polynya.engines.train import TrainingEngine

    from tests.core.test_fused import _counted
    from tests.engines.common import full_weights, make_batch, train_config

    calls = dict.fromkeys(("norm_fwd", "norm_bwd", "rope_fwd", "rope_bwd"), 0)
    _counted(calls)  # a child process of its own: nothing to restore
    batch = make_batch(11, old=True)
    out = []
    for fuse in (False, True):
        engine = TrainingEngine(train_config(3, gradient_checkpointing=True, fused_kernels=fuse,
                                             micro_batch_tokens=1 << 12))
        assert bool(fused_modules(engine.module)) == fuse
        m = engine.forward_backward(batch)
        s = engine.step()
        out.append((m["loss"], s["grad_norm"], full_weights(engine.module), dict(calls)))
    (l0, g0, w0, c0), (l1, g1, w1, c1) = out
    assert not any(c0.values())
    # 9 norms: each layer's 4 run twice (forward + checkpoint recompute), the final one once;
    # RoPE once per layer in the forward, once in the recompute
    assert c1 == {"norm_fwd": 9 + 8, "norm_bwd": 9, "rope_fwd": 4, "rope_bwd": 2}, c1
    assert l1 == pytest.approx(l0, rel=1e-5) and g1 == pytest.approx(g0, rel=1e-4)
    for name in w0:
        torch.testing.assert_close(w1[name], w0[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_zero3_checkpointed_step_under_interpreter():
    check_under_interpreter(__file__)


def _interp():
    from polynya.kernels.norm import op as norm_op
    from polynya.kernels.rope import op as rope_op

    norm_op.KERNEL_ON_CPU = rope_op.KERNEL_ON_CPU = True
    check_zero3_step()
    print("INTERP OK")


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _interp()

"""The ZeRO-1/2 step's multi-tensor gradient checks (``polynya.engines._grad_checks``) against
DeepSpeed's own per-tensor methods: the same overflow answer for NaN, +inf, -inf and huge finite
values placed anywhere, the same global norm, and training that ends in the same weights; on the
CPU and (marked ``gpu``) on CUDA, whose multi-tensor kernels are other code."""
from __future__ import annotations

import pytest
import torch
from polynya.config.train import OptimConfig
from polynya.engines import train as train_module
from polynya.engines._grad_checks import _grad_norm, _has_overflow
from polynya.engines.train import TrainingEngine

from .common import full_weights, make_batch, optimizer_state, train_config

FUSED = ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def engine_for(stage: int, dtype: str = "float32", clip: float = 1.0, device: str = "cpu") -> TrainingEngine:
    return TrainingEngine(train_config(stage, dtype=dtype, device=device,
                                       optim=OptimConfig(grad_clip=clip, eps=1e-3)))


@pytest.mark.parametrize("stage,fused", [(0, False), (1, True), (2, True), (3, False)])
def test_applied_to_the_zero_1_2_optimizer_only(stage, fused):
    opt = engine_for(stage).engine.optimizer
    assert all((name in vars(opt)) == fused for name in FUSED)


def poke(value: float, where: int):
    """Put ``value`` into one element of the ``where``-th partitioned gradient (counted over all
    groups, modulo their number) at a pseudo-random offset."""
    def apply(opt) -> None:
        grads = [g for i in range(len(opt.bit16_groups)) for g in opt.averaged_gradients[i] if g is not None]
        g = grads[where % len(grads)]
        g.view(-1)[(where * 7919) % g.numel()] = value
    return apply


# (name, damage, non-finite element, step skipped): a finite 1e30 is no overflow, but its squared
# norm overflows fp32, so DeepSpeed masks the norm to -1 and skips the step, both ways.
CASES = [("clean", None, False, False), ("nan first", poke(float("nan"), 0), True, True),
         ("+inf middle", poke(float("inf"), 17), True, True), ("-inf last", poke(float("-inf"), -1), True, True),
         ("huge finite", poke(1e30, 5), False, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_same_answers_as_deepspeed(stage, dtype, device):
    """Each check runs both ways on the same gradients. bf16 runs the overflow check, then the
    norm; fp32 runs only the norm (DeepSpeed skips on a non-finite one, masked to -1)."""
    engine = engine_for(stage, dtype, device=device)
    opt, cls = engine.engine.optimizer, type(engine.engine.optimizer)
    seen, pending = [], []

    def damage():
        while pending:
            pending.pop()(opt)

    def overflow():
        damage()
        ours, theirs = _has_overflow(opt), cls.has_overflow_partitioned_grads_serial(opt)
        seen.append(("overflow", bool(ours), bool(theirs)))
        return ours

    def norm(gradients, params, norm_type=2):
        damage()
        ours = _grad_norm(opt, gradients, params, norm_type)
        theirs = cls.get_grad_norm_direct(opt, gradients, params, norm_type)
        seen.append(("norm", float(ours), float(theirs)))
        return ours

    opt.has_overflow_partitioned_grads_serial, opt.get_grad_norm_direct = overflow, norm
    for k, (name, case, bad, skipped) in enumerate(CASES):
        seen.clear()
        pending[:] = [case] if case is not None else []
        engine.forward_backward(make_batch(60 + k))
        out = engine.step()
        assert not pending, name  # the damage was done before a check ran
        checks = [s for s in seen if s[0] == "overflow"]
        assert len(checks) == (dtype == "bfloat16"), name
        assert all(ours == theirs == bad for _, ours, theirs in checks), name
        assert out["skipped"] == float(skipped), name
        norms = [s for s in seen if s[0] == "norm"]
        assert len(norms) == (0 if checks and bad else len(opt.bit16_groups)), name
        for _, ours, theirs in norms:
            if skipped:
                assert ours == theirs == -1.0, name  # DeepSpeed's mask for a non-finite norm
            else:
                assert ours > 0 and ours == pytest.approx(theirs, rel=1e-6), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [1, 2])
def test_training_ends_in_the_same_weights(stage, device, monkeypatch):
    """Three steps with clipping (the norm sets every update's scale) and a poisoned one between:
    the fused engine and DeepSpeed's own end in the same weights, optimizer state and norms."""
    def run():
        engine, norms = engine_for(stage, clip=0.05, device=device), []
        for seed in (70, 71, None, 72):
            batch = make_batch(seed if seed is not None else 73)
            if seed is None:
                batch.advantages[:] = torch.where(torch.arange(len(batch)) % 2 == 0, 3e38, -3e38)
            engine.forward_backward(batch)
            out = engine.step()
            norms.append((out["grad_norm"], out["skipped"]))
        return full_weights(engine.module), optimizer_state(engine), norms

    fused = run()
    monkeypatch.setattr(train_module, "fuse_grad_checks", lambda optimizer: False)
    plain = run()
    assert [s for _, s in fused[2]] == [s for _, s in plain[2]] == [0.0, 0.0, 1.0, 0.0]
    for (a, _), (b, _) in zip(fused[2], plain[2]):
        assert a == pytest.approx(b, rel=1e-6) or not (torch.isfinite(torch.tensor(a)) or torch.isfinite(torch.tensor(b)))
    for x, y in zip(list(fused[0].values()) + fused[1], list(plain[0].values()) + plain[1]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)

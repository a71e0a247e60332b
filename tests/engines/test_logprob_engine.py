"""LogProbEngine (ZeRO 0 and 3) against ``polynya.compute_logprobs`` on the plain model."""
from __future__ import annotations

import polynya
import pytest
import torch
from polynya.config.logprob import LogProbConfig
from polynya.engines.logprob import LogProbEngine
from polynya.engines.train import TrainingEngine
from polynya.models import load_model

from .common import MODEL, make_batch, train_config


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("zorro", [True, False])
def test_matches_compute_logprobs_on_plain_model(stage, zorro):
    batch = make_batch(20, groups=5)
    engine = LogProbEngine(LogProbConfig(MODEL, dtype="float32", zero_stage=stage, zorro=zorro,
                                         micro_batch_tokens=40, seed=3))
    got = engine.compute_logprobs(batch, entropy=True, temperature=0.7)
    model = load_model(MODEL, dtype="float32", seed=3)
    with torch.no_grad():
        want = polynya.compute_logprobs(model, batch, zorro=zorro, entropy=True, temperature=0.7)
    assert torch.equal(got.mask, want.mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)
    assert (got.logprobs[~got.mask] == 0).all() and (got.logprobs[got.mask] < 0).all()


@pytest.mark.parametrize("stage", [0, 3])
def test_load_weights_from_trainer(stage):
    trainer = TrainingEngine(train_config(2, lr=1e-2))
    trainer.forward_backward(make_batch(21, old=True))
    trainer.step()
    engine = LogProbEngine(LogProbConfig(MODEL, dtype="float32", zero_stage=stage, micro_batch_tokens=48))
    batch = make_batch(22)
    assert engine.weight_checksum() != trainer.weight_checksum()
    assert engine.load_weights(trainer.export_weights(bucket_bytes=30_000)) == 1 == engine.weight_version
    assert engine.weight_checksum() == trainer.weight_checksum()
    torch.testing.assert_close(engine.compute_logprobs(batch).logprobs,
                               trainer.compute_logprobs(batch).logprobs, rtol=0, atol=0)
    # single (name, tensor) pairs work too, and bad pieces are refused before anything is copied
    name, p = next(iter(trainer.module.named_parameters()))
    before = engine.weight_checksum()
    with pytest.raises(ValueError):
        engine.load_weights([(name, torch.zeros(3))])
    with pytest.raises(ValueError):
        engine.load_weights([(["no.such.weight"], torch.zeros(3))])
    with pytest.raises(ValueError):
        engine.load_weights([([name], torch.zeros(p.numel() + 1))])
    assert engine.weight_checksum() == before
    assert engine.weight_version == 1
    assert engine.load_weights((name, torch.zeros_like(p.data))) == 2
    assert engine.weight_checksum() != before


def test_bad_config_and_batch():
    with pytest.raises(ValueError):
        LogProbConfig(MODEL, zero_stage=2)
    with pytest.raises(ValueError):
        LogProbConfig(MODEL, dtype="float16")
    engine = LogProbEngine(LogProbConfig(MODEL, dtype="float32"))
    with pytest.raises(ValueError):
        engine.compute_logprobs({"prompt_ids": [[1]]})

"""TrainingEngine.forward_backward_local / zero_grad: an external loss (a framework's own) gets
the same update as forward_backward with polynya's loss (the oracle), on every ZeRO stage."""
from __future__ import annotations

import pytest
import torch
from polynya.engines.train import TrainingEngine
from polynya.losses import Normalizer, policy_loss

from .common import full_weights, make_batch, train_config
from .test_train_engine import assert_same_tensors_close, off_policy


def external_loss(engine: TrainingEngine, batch):
    """polynya's own loss, called from outside with the global normaliser (as verl's is)."""
    norm = Normalizer.from_mask(batch.response_mask())
    seen = []

    def loss_fn(rows, stats):
        mb = batch.select(rows)
        seen.append(list(rows))
        out = policy_loss(engine.loss_spec, stats.logprobs, mb.advantages, stats.mask, norm,
                          old_logprobs=mb.old_logprobs)
        return out.loss

    return loss_fn, seen


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_external_loss_same_update_as_forward_backward(stage):
    ref = TrainingEngine(train_config(stage))
    batch = off_policy(ref, make_batch(3))
    ref.forward_backward(batch)
    g_ref = ref.step()["grad_norm"]

    engine = TrainingEngine(train_config(stage))
    loss_fn, seen = external_loss(engine, batch)
    parts = engine.forward_backward_local(batch, loss_fn, entropy=True)
    g = engine.step()["grad_norm"]
    assert len(parts) >= 2 and sorted(r for p in seen for r in p) == list(range(len(batch)))
    assert [rows for rows, _ in parts] == seen
    for rows, stats in parts:  # detached, in the micro-batch's row order, entropy computed
        assert not stats.logprobs.requires_grad and stats.entropy is not None
        assert stats.logprobs.shape[0] == len(rows)
    assert g == pytest.approx(g_ref, rel=1e-5)
    assert_same_tensors_close(full_weights(engine.module), full_weights(ref.module))


def test_forward_only_matches_compute_logprobs_and_keeps_weights():
    engine = TrainingEngine(train_config(2))
    batch = make_batch(4)
    before = full_weights(engine.module)
    parts = engine.forward_backward_local(batch, None, backward=False)
    want = engine.compute_logprobs(batch).logprobs
    for rows, stats in parts:
        torch.testing.assert_close(stats.logprobs, want[rows, :stats.logprobs.shape[1]], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="forward_backward"):
        engine.step()  # nothing accumulated
    assert_same_tensors_close(full_weights(engine.module), before)


@pytest.mark.parametrize("stage", [0, 2])
def test_zero_grad_checks_and_refuses_to_drop_pending_gradients(stage):
    a = make_batch(5, old=True)
    e1 = TrainingEngine(train_config(stage))
    e1.zero_grad()  # nothing pending: a no-op
    e1.forward_backward(a)
    with pytest.raises(RuntimeError, match="pending"):
        e1.zero_grad()
    g1 = e1.step()["grad_norm"]  # the refused call changed nothing
    e1.zero_grad()
    e2 = TrainingEngine(train_config(stage))
    e2.forward_backward(a)
    assert e2.step()["grad_norm"] == pytest.approx(g1, rel=1e-6)
    assert_same_tensors_close(full_weights(e1.module), full_weights(e2.module))


def test_backward_needs_a_loss():
    engine = TrainingEngine(train_config(0))
    with pytest.raises(ValueError, match="loss_fn"):
        engine.forward_backward_local(make_batch(0), None)

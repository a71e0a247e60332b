"""TrainingEngine where a micro-batch has nothing to learn from, or fails half-way.

A micro-batch whose responses are all empty still runs its (zero) backward, so the update equals
the one-micro-batch update. A forward_backward that fails after a backward began leaves a
partial gradient that ZeRO cannot drop (nor a checkpoint load): the engine refuses to
accumulate, step or load on it, and a new engine loaded from a checkpoint trains on. A load that
fails after DeepSpeed began leaves the engine refusing all but another load.
"""
from __future__ import annotations

import pytest
import torch
from polynya import RolloutBatch
from polynya.engines.train import TrainingEngine
from polynya.zorro.batching import plan_micro_batches

from .common import full_weights, make_batch, train_config


def with_empty_group(empty_first: bool) -> RolloutBatch:
    """Two groups under an 8-token micro-batch budget: one with responses, one whose responses
    are all empty; ``empty_first`` puts the empty group's micro-batch first in the plan."""
    short, long = [5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16]
    if empty_first:
        return RolloutBatch([short] * 2 + [long] * 2, [[20, 21], [22], [], []],
                            advantages=[1.0, -1.0, 0.5, -0.5])
    return RolloutBatch([long] * 2 + [[30]] * 2, [[20, 21], [22], [], []],
                        advantages=[1.0, -1.0, 0.5, -0.5])


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("empty_first", [True, False])
def test_a_micro_batch_without_response_tokens_is_a_zero_backward(stage, empty_first):
    batch = with_empty_group(empty_first)
    plan = plan_micro_batches(batch, rank=0, world=1, max_tokens=8, zorro=True)
    assert len(plan) == 2 and (sorted(plan[0][0]) == [2, 3]) == empty_first  # the case meant
    out = []
    for budget in (8, 100_000):
        engine = TrainingEngine(train_config(stage, micro_batch_tokens=budget))
        m = engine.forward_backward(batch)
        s = engine.step()
        out.append((m, s, full_weights(engine.module)))
    (m_split, s_split, w_split), (m_one, s_one, w_one) = out
    assert (m_split["micro_batches"], m_one["micro_batches"]) == (2, 1)
    assert m_split["response_tokens"] == m_one["response_tokens"] == 3
    assert m_split["loss"] == pytest.approx(m_one["loss"], rel=1e-5, abs=1e-7)
    assert s_split["grad_norm"] == pytest.approx(s_one["grad_norm"], rel=1e-5) and s_one["grad_norm"] > 0
    for name in w_one:
        torch.testing.assert_close(w_split[name], w_one[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 2])
def test_external_loss_on_a_micro_batch_without_response_tokens(stage):
    """forward_backward_local with a loss over an empty micro-batch (verl's path) runs its
    backward too; the returned stats are the micro-batches' own."""
    engine = TrainingEngine(train_config(stage, micro_batch_tokens=8))
    batch = with_empty_group(True)
    out = engine.forward_backward_local(batch, lambda rows, st: (st.logprobs * st.mask).sum())
    assert [sorted(r) for r, _ in out] == [[2, 3], [0, 1]]
    assert out[0][1].logprobs.shape == (2, 0) and out[1][1].mask.sum() == 3
    assert engine.step()["grad_norm"] > 0


def _fail_at_backward(engine: TrainingEngine, call: int) -> None:
    """Make the engine's ``call``-th DeepSpeed backward (1-based) raise, after the earlier ones ran."""
    real, calls = engine.engine.backward, []

    def backward(*args, **kw):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("injected: device fault in backward")
        return real(*args, **kw)
    engine.engine.backward = backward


@pytest.mark.parametrize("stage", [0, 2])
def test_a_forward_backward_that_fails_half_way_is_not_stepped_on(stage, tmp_path):
    engine = TrainingEngine(train_config(stage, micro_batch_tokens=24))
    engine.save(str(tmp_path))
    before = full_weights(engine.module)
    batch = make_batch(3)
    _fail_at_backward(engine, 2)
    with pytest.raises(RuntimeError, match="injected"):
        engine.forward_backward(batch)
    for call in (engine.step, lambda: engine.forward_backward(batch), engine.zero_grad,
                 lambda: engine.forward_backward_local(batch, lambda rows, st: st.logprobs.sum()),
                 lambda: engine.load(str(tmp_path))):
        with pytest.raises(RuntimeError, match=r"failed after the backward of 2 of its \d+ micro-batches"
                                               r".*new TrainingEngine"):
            call()
    after = full_weights(engine.module)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was applied
    fresh = TrainingEngine(train_config(stage, micro_batch_tokens=24))
    fresh.load(str(tmp_path))  # what the error says to do: a clean engine's step
    clean = TrainingEngine(train_config(stage, micro_batch_tokens=24))
    assert (fresh.forward_backward(batch)["loss"], fresh.step()["grad_norm"]) == pytest.approx(
        (clean.forward_backward(batch)["loss"], clean.step()["grad_norm"]), rel=1e-6)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_load_refuses_pending_gradients(stage, tmp_path):
    """DeepSpeed keeps accumulated gradients across load_checkpoint: a load() between
    forward_backward and step() would add them to the loaded state's next update."""
    engine = TrainingEngine(train_config(stage, micro_batch_tokens=24))
    engine.save(str(tmp_path))
    engine.forward_backward(make_batch(5))
    with pytest.raises(RuntimeError, match=r"load\(\) with the gradients of 1 forward_backward call"):
        engine.load(str(tmp_path))
    engine.step()
    engine.load(str(tmp_path))  # nothing pending: loads
    batch = make_batch(3)
    clean = TrainingEngine(train_config(stage, micro_batch_tokens=24))
    assert (engine.forward_backward(batch)["loss"], engine.step()["grad_norm"]) == pytest.approx(
        (clean.forward_backward(batch)["loss"], clean.step()["grad_norm"]), rel=1e-6)


def test_a_failure_before_any_backward_leaves_the_engine_usable():
    engine = TrainingEngine(train_config(0, micro_batch_tokens=24))
    batch = make_batch(3)
    real = engine._logprobs

    def fails(*args, **kw):
        raise RuntimeError("injected: out of memory in the first forward")
    engine._logprobs = fails
    with pytest.raises(RuntimeError, match="injected"):
        engine.forward_backward(batch)
    with pytest.raises(RuntimeError, match="needs a forward_backward"):
        engine.step()  # nothing accumulated, nothing torn
    engine._logprobs = real
    engine.forward_backward(batch)
    assert engine.step()["grad_norm"] > 0


@pytest.mark.parametrize("stage", [0, 2])
def test_a_load_that_fails_part_way_is_not_trained_on(stage, tmp_path):
    """A checkpoint whose pickles are sound but whose optimizer file DeepSpeed cannot use: the
    load fails after DeepSpeed replaced the weights. The engine then refuses to train, export
    or save until a load succeeds; a good load then trains as a fresh engine loaded from it."""
    import os
    import shutil

    from polynya.files import write_manifest

    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    engine = TrainingEngine(train_config(stage, micro_batch_tokens=24))
    engine.save(good)
    engine.forward_backward(make_batch(5))
    engine.step()  # the weights move on from the checkpoint's
    shutil.copytree(good, bad)
    folder = os.path.join(bad, "polynya")
    (optim,) = [f for f in os.listdir(folder) if "optim" in f] or [sorted(os.listdir(folder))[-1]]
    torch.save({"not": "an optimizer state"}, os.path.join(folder, optim))  # weights-only safe
    os.remove(os.path.join(bad, "MANIFEST.json"))
    write_manifest(bad)
    with pytest.raises(Exception):
        engine.load(bad)
    batch = make_batch(3)
    for call in (lambda: engine.forward_backward(batch), engine.step, lambda: engine.compute_logprobs(batch),
                 lambda: list(engine.export_weights()), lambda: engine.save(str(tmp_path / "again")),
                 engine.weight_checksum):
        with pytest.raises(RuntimeError, match="failed part-way.*load\\(\\) a sound checkpoint first"):
            call()
    assert not os.path.exists(tmp_path / "again")
    engine.load(good)
    fresh = TrainingEngine(train_config(stage, micro_batch_tokens=24))
    fresh.load(good)
    assert engine.weight_checksum() == fresh.weight_checksum()
    assert (engine.forward_backward(batch)["loss"], engine.step()["grad_norm"]) == pytest.approx(
        (fresh.forward_backward(batch)["loss"], fresh.step()["grad_norm"]), rel=1e-6)

"""TrainingEngine on CPU (one process, gloo): every ZeRO stage against itself and stage 0.

The two-process runs live in ``test_dp.py``.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from polynya import RolloutBatch
from polynya.config.train import LossConfig, TrainConfig
from polynya.checksum import checksum_named_tensors
from polynya.engines.train import TrainingEngine

from .common import assert_same_tensors, full_weights, make_batch, optimizer_state, train_config

STAGES = [0, 1, 2, 3]


def off_policy(engine: TrainingEngine, batch: RolloutBatch) -> RolloutBatch:
    """The batch with old log-probs = the engine's current policy plus noise (ratios != 1)."""
    lp = engine.compute_logprobs(batch).logprobs.cpu()
    noise = 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    return RolloutBatch(batch.prompts, batch.responses, advantages=batch.advantages,
                        old_logprobs=(lp + noise) * batch.response_mask())


@pytest.mark.parametrize("stage", STAGES)
def test_loss_decreases(stage):
    engine = TrainingEngine(train_config(stage, loss="dapo", lr=1e-2, optim={"eps": 1e-6, "grad_clip": 0.0}))
    batch = off_policy(engine, make_batch(0, adv_per_token=True))
    losses = []
    for _ in range(5):
        m = engine.forward_backward(batch)
        s = engine.step()
        losses.append(m["loss"])
        assert math.isfinite(s["grad_norm"]) and s["lr"] == pytest.approx(1e-2)
    assert m["response_tokens"] == int(batch.response_mask().sum()) and m["sequences"] == len(batch)
    assert 0 <= m["clip_frac"] <= 1 and m["entropy"] > 0
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("stage", STAGES)
def test_zorro_on_off_same_loss_and_grad_norm(stage):
    ref = TrainingEngine(train_config(stage, zorro=False))
    batch = off_policy(ref, make_batch(1))
    results = []
    for zorro in (True, False):
        engine = TrainingEngine(train_config(stage, zorro=zorro))
        m = engine.forward_backward(batch)
        assert m["micro_batches"] >= 1
        assert m["zorro_micro_batches"] == (m["micro_batches"] if zorro else 0)  # which layout ran
        s = engine.step()
        results.append((m["loss"], s["grad_norm"], full_weights(engine.module)))
    (l1, g1, w1), (l0, g0, w0) = results
    assert l1 == pytest.approx(l0, rel=1e-5) and abs(l0) > 1e-4
    assert g1 == pytest.approx(g0, rel=1e-5)
    for name in w0:
        torch.testing.assert_close(w1[name], w0[name], rtol=1e-5, atol=1e-6)


def test_zorro_micro_batches_count_what_auto_ran(monkeypatch):
    """``zorro_attention="auto"`` runs a micro-batch too small to pay in the packed naive layout
    (``zorro_pays``): the metrics say how many ran ZoRRo."""
    import polynya.logprobs

    engine = TrainingEngine(train_config(0, zorro=True, micro_batch_tokens=10))
    batch = off_policy(engine, make_batch(2))
    calls = []

    def every_other(model, mb, attention):
        calls.append(1)
        return len(calls) % 2 == 1

    monkeypatch.setattr(polynya.logprobs, "zorro_pays", every_other)
    m = engine.forward_backward(batch)
    assert m["micro_batches"] >= 3 and len(calls) == m["micro_batches"]
    assert m["zorro_micro_batches"] == (m["micro_batches"] + 1) // 2


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "gspo"])
def test_more_micro_batches_same_update(stage, loss):
    batch = make_batch(2, adv_per_token=(loss != "gspo"))
    out = []
    for budget in (10, 100_000):
        engine = TrainingEngine(train_config(stage, loss=loss, micro_batch_tokens=budget))
        m = engine.forward_backward(off_policy(engine, batch))
        s = engine.step()
        out.append((m, s, full_weights(engine.module)))
    (m_small, s_small, w_small), (m_big, s_big, w_big) = out
    assert m_small["micro_batches"] >= 3 and m_big["micro_batches"] == 1
    assert m_small["loss"] == pytest.approx(m_big["loss"], rel=1e-5)
    assert s_small["grad_norm"] == pytest.approx(s_big["grad_norm"], rel=1e-5)
    for name in w_big:
        torch.testing.assert_close(w_small[name], w_big[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", STAGES)
def test_weights_match_stage0(stage):
    """The same step under any ZeRO stage gives stage 0's weights (one process)."""
    batch = make_batch(3, old=True)
    weights = []
    for s in (0, stage):
        engine = TrainingEngine(train_config(s))
        engine.forward_backward(batch)
        engine.step()
        weights.append(full_weights(engine.module))
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stage", STAGES)
def test_save_load_resumes_exactly(stage, dtype, tmp_path):
    """bf16 too: its DeepSpeed checkpoint (bf16 optimizer, fp32 master partitions) must load
    through the weights-only allow-list of ``polynya.engines._deepspeed.checkpoint_types``."""
    cfg = train_config(stage, dtype=dtype, optim={"eps": 1e-3, "schedule": "warmup_cosine", "warmup_steps": 1, "total_steps": 10,
                                     "grad_clip": 1.0, "weight_decay": 0.01})
    batches = [make_batch(10 + i, old=True) for i in range(5)]
    a = TrainingEngine(cfg)
    for b in batches[:2]:
        a.forward_backward(b)
        a.step()
    a.save(str(tmp_path))
    expected = [(a.forward_backward(b)["loss"], a.step()) for b in batches[2:]]
    b_engine = TrainingEngine(cfg)
    b_engine.load(str(tmp_path))
    got = [(b_engine.forward_backward(b)["loss"], b_engine.step()) for b in batches[2:]]
    assert got == expected  # losses, grad norms, lrs and step counts, exactly
    assert b_engine.weight_checksum() == a.weight_checksum()


@pytest.mark.parametrize("stage", STAGES)
def test_export_weights_reassembles_exactly(stage):
    engine = TrainingEngine(train_config(stage))
    engine.forward_backward(make_batch(4, old=True))
    engine.step()
    truth = full_weights(engine.module)
    bucket = 20_000
    got, pieces = {}, 0
    for names, flat in engine.export_weights(bucket):
        pieces += 1
        assert flat.dim() == 1 and flat.dtype == torch.float32
        assert len(names) == 1 or flat.numel() * 4 <= bucket
        off = 0
        for n in names:
            k = truth[n].numel()
            got[n] = flat[off:off + k].view(truth[n].shape).cpu()
            off += k
        assert off == flat.numel()
    assert pieces > 3 and list(got) == list(truth)
    assert_same_tensors(got, truth)
    assert engine.weight_checksum(bucket) == checksum_named_tensors(truth.items())
    assert engine.weight_checksum() == engine.weight_checksum(bucket)


def _bad_batches(good: RolloutBatch) -> dict[str, RolloutBatch]:
    b, r = len(good), good.max_response_len
    nan_adv = copy.copy(good)
    nan_adv.advantages = good.advantages.clone()
    nan_adv.advantages[1] = float("nan")
    wrong_old = copy.copy(good)
    wrong_old.old_logprobs = torch.zeros(b, r + 1)
    nan_old = copy.copy(good)
    nan_old.old_logprobs = torch.full((b, r), float("nan"))
    no_adv = RolloutBatch(good.prompts, good.responses)
    no_tokens = RolloutBatch(good.prompts[:2], [[], []], advantages=torch.ones(2))
    return {"nan_adv": nan_adv, "wrong_old": wrong_old, "nan_old": nan_old, "no_adv": no_adv,
            "no_tokens": no_tokens, "not_a_batch": {"prompt_ids": good.prompts}}


@pytest.mark.parametrize("stage", STAGES)
def test_bad_input_raises_and_leaves_state_unchanged(stage):
    good = make_batch(5, old=True)
    engine = TrainingEngine(train_config(stage, loss_config=LossConfig(kl_coef=0.1)))
    reference = TrainingEngine(train_config(stage, loss_config=LossConfig(kl_coef=0.1)))
    with_ref = RolloutBatch(good.prompts, good.responses, advantages=good.advantages,
                            old_logprobs=good.old_logprobs, ref_logprobs=good.old_logprobs - 0.1)
    for e in (engine, reference):  # one real step first: non-empty optimizer state
        e.forward_backward(with_ref)
        e.step()
    weights, opt_state = full_weights(engine.module), optimizer_state(engine)
    bad = _bad_batches(with_ref)
    bad["missing_ref"] = good  # kl_coef > 0 needs ref_logprobs
    for batch in bad.values():
        with pytest.raises(ValueError):
            engine.forward_backward(batch)
    with pytest.raises(RuntimeError):
        engine.step()  # nothing accumulated by the failed calls
    assert_same_tensors(full_weights(engine.module), weights)
    assert_same_tensors(optimizer_state(engine), opt_state)
    # and the next real step is the one an engine that never saw bad input takes
    nxt = make_batch(6, old=True)
    nxt = RolloutBatch(nxt.prompts, nxt.responses, advantages=nxt.advantages,
                       old_logprobs=nxt.old_logprobs, ref_logprobs=nxt.old_logprobs + 0.05)
    assert engine.forward_backward(nxt)["loss"] == reference.forward_backward(nxt)["loss"]
    assert engine.step() == reference.step()
    assert_same_tensors(full_weights(engine.module), full_weights(reference.module))


def test_bad_construction_raises():
    with pytest.raises(ValueError):
        RolloutBatch([], [])
    with pytest.raises(ValueError):
        RolloutBatch([[1, 2]], [[3]], advantages=torch.tensor([float("nan")]))
    with pytest.raises(ValueError):
        RolloutBatch([[1, 2]], [[3, 4]], old_logprobs=torch.zeros(1, 3))
    with pytest.raises(ValueError):
        TrainConfig("tiny:qwen3", loss="reinforce++")
    with pytest.raises(ValueError):
        TrainingEngine("tiny:qwen3")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_forward_backward_calls_add_up(stage):
    """forward_backward(a); compute_logprobs(c); forward_backward(b); step() == one step on the
    loss a + b (same as ZeRO-0), and differs from a step on a alone."""
    a, b, c = make_batch(7, old=True), make_batch(8, old=True), make_batch(13)
    e1 = TrainingEngine(train_config(stage))
    e1.forward_backward(a)
    e1.compute_logprobs(c)
    e1.forward_backward(b)
    g1 = e1.step()["grad_norm"]
    e2 = TrainingEngine(train_config(stage))
    e2.forward_backward(a)
    assert e2.step()["grad_norm"] != pytest.approx(g1, rel=1e-3)
    e3 = TrainingEngine(train_config(0))
    e3.forward_backward(a)
    e3.forward_backward(b)
    assert e3.step()["grad_norm"] == pytest.approx(g1, rel=1e-5)
    assert_same_tensors_close(full_weights(e1.module), full_weights(e3.module))


def assert_same_tensors_close(a: dict, b: dict) -> None:
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_onload_roundtrip_keeps_training(stage):
    """On CPU the same DeepSpeed moves run (into host memory): training must continue exactly."""
    engine = TrainingEngine(train_config(stage))
    twin = TrainingEngine(train_config(stage))
    first, batch = make_batch(9, old=True), make_batch(10, old=True)
    for e in (engine, twin):  # non-empty optimizer state
        e.forward_backward(first)
        e.step()
    info = engine.offload()
    assert set(info) == {"before", "after", "freed_fraction"}
    with pytest.raises(RuntimeError):
        engine.forward_backward(batch)
    engine.onload()
    assert engine.forward_backward(batch)["loss"] == twin.forward_backward(batch)["loss"]
    assert engine.step() == twin.step()
    assert_same_tensors(full_weights(engine.module), full_weights(twin.module))
    assert_same_tensors(optimizer_state(engine), optimizer_state(twin))


def test_make_room_on_cpu_never_moves_and_refuses_bad_sizes():
    engine = TrainingEngine(train_config(2))
    assert engine.make_room(0) is False and engine.make_room(1 << 50) is False
    assert not engine._offloaded  # host memory: nothing to give back
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="byte count"):
            engine.make_room(bad)


@pytest.mark.parametrize("free, after_cache, moved", [(100, None, False), (10, 100, False),
                                                      (10, 20, True)],
                         ids=["free", "after-cache", "short"])
def test_make_room_decision_on_a_device(monkeypatch, free, after_cache, moved):
    """The CUDA path's decision on a stand-in engine: free bytes first as the device reports
    them, then after PyTorch's cached blocks go back; offload only when still short."""
    from types import SimpleNamespace

    from polynya.engines import train as train_module

    seen = [free, after_cache]
    calls = []
    monkeypatch.setattr(train_module, "_free", lambda device: seen.pop(0))
    monkeypatch.setattr(train_module.dsu, "free_accelerator_cache", lambda: calls.append("cache"))
    fake = SimpleNamespace(_offloaded=False, device=torch.device("cuda"),
                           offload=lambda: calls.append("offload"))
    assert TrainingEngine.make_room(fake, 50) is moved
    assert calls == ([] if after_cache is None else ["cache"]) + (["offload"] if moved else [])


def test_offload_needs_zero():
    engine = TrainingEngine(train_config(0))
    with pytest.raises(NotImplementedError):
        engine.offload()


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_checkpointing_same_step(stage):
    batch = make_batch(11, old=True)
    out = []
    for ckpt in (False, True):
        engine = TrainingEngine(train_config(stage, gradient_checkpointing=ckpt))
        out.append((engine.forward_backward(batch)["loss"], engine.step()["grad_norm"]))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-6)
    assert out[1][1] == pytest.approx(out[0][1], rel=1e-5)


def test_lr_schedule_reported_by_step():
    cfg = train_config(1, lr=1e-3, optim={"eps": 1e-3, "schedule": "warmup_cosine", "warmup_steps": 2,
                                          "total_steps": 6, "min_lr_ratio": 0.1})
    engine = TrainingEngine(cfg)
    batch = make_batch(12, old=True)
    lrs = []
    for _ in range(7):
        engine.forward_backward(batch)
        lrs.append(engine.step()["lr"])
    assert lrs == pytest.approx([1e-3 * cfg.optim.lr_factor(s) for s in range(7)], rel=1e-9)
    assert lrs[0] < lrs[2] and lrs[-1] == pytest.approx(1e-4)

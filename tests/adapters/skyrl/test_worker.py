"""SkyRL's training-batch format through the polynya policy worker (DeepSpeed ``TrainingEngine``,
ZoRRo on) gives the loss and gradients of a plain-torch reference written from SkyRL's worker
(``PolicyWorkerBase._forward_backward_micro``: clipped PPO over loss-mask tokens with the
advantages pre-scaled by ``loss_reduction``, plus ``kl_loss_coef`` x the mean per-sequence k3 KL),
run on the same padded batch with a plain HF forward; fp32, 1e-5.

The batch is built with SkyRL's own ``convert_prompts_responses_to_batch_tensors`` and
``TrainingInputBatch``.
"""
from __future__ import annotations

import pytest
import torch
from polynya.adapters.skyrl import PolicyWorker, RefWorker, train_config_from_skyrl
from polynya.checksum import checksum_named_tensors
from polynya.config.logprob import LogProbConfig
from polynya.models import load_model
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.config.config import TrainerConfig
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from .test_config import skyrl_lrs

PAD = 1
TEMPERATURE = 0.8
ALGO = {"policy_loss_type": "regular", "eps_clip_low": 0.2, "eps_clip_high": 0.28,
        "use_kl_loss": True, "kl_loss_coef": 0.05, "kl_estimator_type": "k3",
        "temperature": TEMPERATURE, "loss_reduction": "token_mean"}


def skyrl_batch(seed: int, *, multi_turn: bool = False) -> TrainingInputBatch:
    """Two prompts x three responses (GRPO groups), ragged lengths, SkyRL's layout."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()
    prompts_u = [rand(7), rand(4)]
    prompts, responses, loss_masks = [], [], []
    for p in prompts_u:
        for n in (5, 2, 8):
            prompts.append(p)
            responses.append(rand(n))
            mask = [1] * n
            if multi_turn and n > 4:
                mask[2:4] = [0, 0]  # observation tokens inside the response
            loss_masks.append(mask)
    rewards = [[0.0] * (len(r) - 1) + [float(torch.rand((), generator=g))] for r in responses]
    seqs, attn, resp_mask, _, loss_mask, *_ = convert_prompts_responses_to_batch_tensors(
        PAD, prompts, responses, rewards, loss_masks)
    b, r = resp_mask.shape
    scores = torch.randn(b, generator=g)
    adv = scores[:, None] * resp_mask
    adv = adv / loss_mask.sum().clamp(min=1)  # SkyRL's token_mean pre-scaling of the mini-batch
    data = TrainingInputBatch({
        "sequences": seqs, "attention_mask": attn, "response_mask": resp_mask,
        "loss_mask": loss_mask, "advantages": adv,
        "action_log_probs": None, "base_action_log_probs": None})
    data.metadata = {"response_length": r}
    return data


def reference_logprobs(model, data, temperature: float = TEMPERATURE) -> torch.Tensor:
    """``[B, R]`` right-aligned action log-probs: a plain HF forward on SkyRL's padded rows."""
    seqs, attn = data["sequences"], data["attention_mask"]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=seqs, attention_mask=attn, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, :-1] / temperature, -1)
    lp = lp.gather(-1, seqs[:, 1:, None])[..., 0]
    return lp[:, -data.metadata["response_length"]:]


def reference_loss(model, data, algo) -> torch.Tensor:
    lp = reference_logprobs(model, data)
    m = data["loss_mask"].float()
    ratio = torch.exp((lp - data["action_log_probs"]).clamp(-20, 20))  # SkyRL's safe_exp_delta
    a = data["advantages"]
    pg = -torch.min(ratio * a, ratio.clamp(1 - algo["eps_clip_low"], 1 + algo["eps_clip_high"]) * a)
    loss = (pg * m).sum()
    if algo["use_kl_loss"]:
        d = (data["base_action_log_probs"] - lp).clamp(-20, 20)
        kl = (torch.exp(d) - d - 1).clamp(-10, 10) * m  # SkyRL's compute_approx_kl (k3)
        loss = loss + algo["kl_loss_coef"] * ((kl.sum(-1) / m.sum(-1).clamp(min=1)).mean())
    return loss


def with_logprobs(data, model, seed: int) -> TrainingInputBatch:
    """Old / reference log-probs near the current ones (ratios off 1, some clipped)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lp = reference_logprobs(model, data)
    rm = data["response_mask"].float()
    data["action_log_probs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * rm
    data["base_action_log_probs"] = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * rm
    return data


def policy_worker(algo) -> PolicyWorker:
    trainer = {"algorithm": algo, "policy": {"optimizer_config": {"lr": 1e-3, "max_grad_norm": 0.0}}}
    return PolicyWorker(train_config_from_skyrl(trainer, "tiny:qwen3", dtype="float32",
                                                zero_stage=0, zorro=True, seed=0))


@pytest.fixture(scope="module")
def ref_model():
    return load_model("tiny:qwen3", dtype="float32", seed=0)


@pytest.mark.parametrize("use_kl, multi_turn", [(True, False), (False, True)])
def test_policy_worker_matches_plain_torch(ref_model, use_kl, multi_turn):
    algo = dict(ALGO, use_kl_loss=use_kl)
    worker = policy_worker(algo)
    module = worker.engine.module
    assert checksum_named_tensors(module.named_parameters()) == checksum_named_tensors(
        ref_model.named_parameters())
    data = with_logprobs(skyrl_batch(3, multi_turn=multi_turn), ref_model, 4)

    # SkyRL's forward (old log-probs): right-aligned, zeros before each response
    got = worker.forward(data)
    with torch.no_grad():
        want = reference_logprobs(ref_model, data) * data["response_mask"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    ref_model.zero_grad()
    loss = reference_loss(ref_model, data, algo)
    loss.backward()
    metrics = worker.forward_backward(data)
    assert metrics["final_loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert ("policy_kl" in metrics) == use_kl
    grads = dict(module.named_parameters())
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    before = checksum_named_tensors(module.named_parameters())
    assert worker.optim_step() > 0
    assert checksum_named_tensors(module.named_parameters()) != before  # the update was applied


def test_ref_worker_matches_plain_torch(ref_model):
    """SkyRL's ``RefWorkerBase._forward_micro_batch`` scores at temperature 1.0 whatever
    ``trainer.algorithm.temperature`` is (the policy's); a reference at another temperature,
    which an earlier version of this test asked for, is refused."""
    data = skyrl_batch(5)
    got = RefWorker(LogProbConfig("tiny:qwen3", dtype="float32")).forward(data)
    with torch.no_grad():
        want = reference_logprobs(ref_model, data, temperature=1.0) * data["response_mask"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"LogProbConfig\.temperature=0\.8: SkyRL's reference worker"):
        RefWorker(LogProbConfig("tiny:qwen3", dtype="float32", temperature=TEMPERATURE))


@pytest.mark.parametrize("scheduler, warmup, total, steps", [
    ("constant", 4, None, 4 + 3),  # the audit's case: SkyRL runs at lr from step 0
    ("cosine", 0, 5, 5),
])
def test_policy_worker_applies_skyrl_lr_schedule(ref_model, scheduler, warmup, total, steps):
    """The rate the engine applies at each optimizer step is the one SkyRL's scheduler gives."""
    trainer = TrainerConfig()
    for k, v in ALGO.items():
        setattr(trainer.algorithm, k, v)
    oc = trainer.policy.optimizer_config
    oc.lr, oc.scheduler, oc.num_warmup_steps = 1e-3, scheduler, warmup
    worker = PolicyWorker(train_config_from_skyrl(trainer, "tiny:qwen3", num_training_steps=total,
                                                  dtype="float32", zero_stage=0, seed=0))
    data = with_logprobs(skyrl_batch(8), ref_model, 9)
    applied = []
    for _ in range(steps):
        worker.forward_backward(data)
        out = worker.engine.step()  # what optim_step runs; it also reports the rate it used
        assert out["skipped"] == 0.0
        applied.append(out["lr"])
    assert applied == skyrl_lrs(trainer, total or 10, steps)


def test_refusals(ref_model):
    with pytest.raises(ValueError, match="policy_loss_type='dual_clip'"):
        policy_worker(dict(ALGO, policy_loss_type="dual_clip"))
    with pytest.raises(ValueError, match="use_entropy_loss"):
        policy_worker(dict(ALGO, use_entropy_loss=True))
    worker = policy_worker(ALGO)
    before = checksum_named_tensors(worker.engine.module.named_parameters())
    data = with_logprobs(skyrl_batch(6, multi_turn=True), ref_model, 7)
    with pytest.raises(ValueError, match="KL loss with a loss_mask narrower"):
        worker.forward_backward(data)
    bad = with_logprobs(skyrl_batch(6), ref_model, 7)
    bad["attention_mask"][0, -1] = 0  # padding inside a row: not SkyRL's layout
    with pytest.raises(ValueError, match="attention_mask row 0 is not right-aligned"):
        worker.forward_backward(bad)
    with pytest.raises(RuntimeError, match="needs a forward_backward"):
        worker.optim_step()  # nothing was accumulated by the refused calls
    assert checksum_named_tensors(worker.engine.module.named_parameters()) == before


def _token_weights(data):
    # SkyRL's KL is a loss-mask-weighted mean per row (masked_mean), polynya's a plain mean
    g = torch.Generator().manual_seed(11)
    data["loss_mask"] = data["loss_mask"] * (0.5 + torch.rand(data["loss_mask"].shape, generator=g))


def _images(data):
    # SkyRL's model forward reads them (HFModelWrapper.forward); token ids alone are another input
    data["pixel_values"] = torch.randn(len(data), 8)
    data["image_grid_thw"] = torch.ones(len(data), 3, dtype=torch.long)


@pytest.mark.parametrize("change, message", [
    pytest.param(_token_weights, "KL loss with a loss_mask narrower.*weights other than 1", id="weights"),
    pytest.param(_images, r"carries \['pixel_values', 'image_grid_thw'\] \(images\)", id="images"),
])
def test_batch_fields_polynya_would_ignore_refused(ref_model, change, message):
    worker = policy_worker(ALGO)
    before = checksum_named_tensors(worker.engine.module.named_parameters())
    data = with_logprobs(skyrl_batch(6), ref_model, 7)
    change(data)
    with pytest.raises(ValueError, match=message):
        worker.forward_backward(data)
    if change is _images:
        with pytest.raises(ValueError, match=message):
            worker.forward(data)
        with pytest.raises(ValueError, match=message):
            RefWorker(LogProbConfig("tiny:qwen3", dtype="float32")).forward(data)
    with pytest.raises(RuntimeError, match="needs a forward_backward"):
        worker.optim_step()  # nothing was accumulated by the refused call
    assert checksum_named_tensors(worker.engine.module.named_parameters()) == before

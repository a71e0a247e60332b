"""The adapter's GRPO loss equals TRL 1.16's over a whole accumulation window, for every loss
setting TRL's ``_compute_loss`` reads.

Oracle: a stock ``trl.GRPOTrainer`` on the same saved tiny Qwen3 (its own log-probs, its own
row shuffle and split). Both trainers get the same generation batch (random, ragged: a
one-token completion, a completion masked out entirely as ``mask_truncated_completions`` leaves
it, old / reference log-probs off the current ones by up to +-4 nats so every clip branch,
``delta`` and the off-policy mask are hit), run ``_prepare_inputs`` + ``compute_loss`` +
``backward`` for each of the ``steps_per_generation`` micro-batches from the same RNG state, and
must end with the same summed loss and the same gradient of every weight (fp32, 1e-5).
Where TRL's loss depends on which rows share a micro-batch (``bnpo``, the entropy bonus,
``top_entropy_quantile``) the adapter must split as TRL does; elsewhere it keeps whole groups.
Settings are set on both trainers' attributes (those ``_compute_loss`` reads) so one pair of
trainers serves every case.
"""
from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset
from polynya.adapters.trl import GRPOTrainer
from polynya.config import SamplerConfig
from polynya.models import tiny_tokenizer

from .common import save_tiny_qwen3

G, PER_DEVICE, STEPS, MAX_LEN, TEMPERATURE = 4, 8, 2, 7, 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory, "tiny_qwen3_loss", 5)


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def _trainer(cls, model_dir, out, **kw):
    args = trl.GRPOConfig(output_dir=str(out), per_device_train_batch_size=PER_DEVICE,
                          gradient_accumulation_steps=STEPS, num_generations=G,
                          max_completion_length=MAX_LEN, temperature=TEMPERATURE, beta=0.04,
                          report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0)
    data = Dataset.from_list([{"prompt": "a b c"}] * 4)
    trainer = cls(model_dir, reward_funcs=_reward, args=args, train_dataset=data,
                  processing_class=tiny_tokenizer(), **kw)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = STEPS  # what Trainer sets in its training loop
    return trainer


@pytest.fixture(scope="module")
def trainers(model_dir, tmp_path_factory):
    ours = _trainer(GRPOTrainer, model_dir, tmp_path_factory.mktemp("ours"),
                    sampler_config=SamplerConfig(model_dir, dtype="float32", kv_cache_memory_gb=0.02))
    theirs = _trainer(trl.GRPOTrainer, model_dir, tmp_path_factory.mktemp("theirs"))
    for n, p in ours.model.named_parameters():
        assert torch.equal(p, dict(theirs.model.named_parameters())[n]), n
    return ours, theirs


def generation_batch(trainer, seed: int, *, old: bool, ref: bool) -> dict:
    """A generation batch as ``_generate_and_score_completions`` returns it: G consecutive rows
    per prompt (left-padded), right-padded ragged completions, per-row advantages."""
    g = torch.Generator().manual_seed(seed)
    rows, n_prompts = PER_DEVICE * STEPS, PER_DEVICE * STEPS // G
    prompts = [torch.randint(5, 500, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
               for _ in range(n_prompts)]
    lens = torch.randint(1, MAX_LEN + 1, (rows,), generator=g)
    lens[3] = 1  # a single-token completion
    p_width = max(len(p) for p in prompts)
    prompt_ids = torch.zeros(rows, p_width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, p_width, dtype=torch.long)
    completion_ids = torch.randint(5, 500, (rows, MAX_LEN), generator=g)
    completion_mask = (torch.arange(MAX_LEN)[None] < lens[:, None]).long()
    for i in range(rows):
        p = prompts[i // G]
        prompt_ids[i, p_width - len(p):] = p
        prompt_mask[i, p_width - len(p):] = 1
    completion_ids = completion_ids * completion_mask
    completion_mask[6] = 0  # truncated and masked out (mask_truncated_completions)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "completion_mask": completion_mask, "advantages": torch.randn(rows, generator=g),
             "num_items_in_batch": completion_mask.sum()}
    with torch.no_grad():  # TRL's own current log-probs, moved by random amounts
        cur, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), MAX_LEN)
    shift = lambda scale: (torch.rand(cur.shape, generator=g) * 2 - 1) * scale
    if old:  # inside the clip range, either side of it, and far out (+-4 nats)
        batch["old_per_token_logps"] = cur + torch.where(torch.rand(cur.shape, generator=g) < 0.3,
                                                         shift(4.0), shift(0.4))
    if ref:
        batch["ref_per_token_logps"] = cur + shift(1.5)
    return batch


# TRL attributes _compute_loss reads (values other than the trainer's defaults)
CASES = {
    "grpo": dict(loss_type="grpo"),
    "grpo-on-policy": dict(loss_type="grpo", _old=False),
    "grpo-kl-two-sided": dict(loss_type="grpo", beta=0.04, epsilon_high=0.28, delta=1.5),
    "grpo-kl-bias-corrected": dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=True),
    "bnpo-kl": dict(loss_type="bnpo", beta=0.04),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.04),
    "dapo-sequence": dict(loss_type="dapo", importance_sampling_level="sequence", epsilon_low=3e-4,
                          epsilon_high=4e-4),
    "dapo-off-policy-mask": dict(loss_type="dapo", off_policy_mask_threshold=0.05),
    "cispo": dict(loss_type="cispo", epsilon_high=2.0),
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "grpo-top-entropy": dict(loss_type="grpo", top_entropy_quantile=0.5),
    "dapo-entropy-bonus": dict(loss_type="dapo", entropy_coef=0.05),
    "grpo-adaptive-entropy": dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.05),
}
FOLLOW_TRL = {"bnpo-kl", "grpo-top-entropy", "dapo-entropy-bonus", "grpo-adaptive-entropy"}
_ARGS = ("delta", "use_bias_correction_kl")  # read from trainer.args


def configure(trainer, case: dict) -> None:
    defaults = dict(loss_type="dapo", beta=0.0, epsilon_low=0.2, epsilon_high=0.2, delta=None,
                    use_bias_correction_kl=False, importance_sampling_level="token",
                    off_policy_mask_threshold=None, top_entropy_quantile=1.0, entropy_coef=0.0,
                    use_adaptive_entropy=False)
    for key, value in {**defaults, **{k: v for k, v in case.items() if not k.startswith("_")}}.items():
        setattr(trainer.args if key in _ARGS else trainer, key, value)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer._last_world_entropy = 0.0  # adaptive control applies the bonus (entropy <= target)
    trainer._entropy_window_stats = None


def window(trainer, batch: dict, seed: int):
    """One accumulation window as TRL's training loop runs it: the summed loss, the gradients
    and the rows of each micro-batch."""
    trainer.model.zero_grad(set_to_none=True)
    trainer._generate_and_score_completions = lambda inputs: {k: v.clone() for k, v in batch.items()}
    trainer._buffered_inputs = None
    torch.manual_seed(seed)
    total, parts = 0.0, []
    for step in range(STEPS):
        trainer._step = step
        inputs = trainer._prepare_inputs([{"prompt": "unused"}] * PER_DEVICE * STEPS)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        total += float(loss.detach())
        parts.append(inputs["advantages"])
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return total, grads, parts


def _rows_of(parts, batch):
    """Each micro-batch's rows of the generation batch (its advantages are distinct floats)."""
    adv = batch["advantages"]
    return [sorted(int((adv == a).nonzero()[0]) for a in part) for part in parts]


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_equal_trl(trainers, name):
    ours, theirs = trainers
    case = CASES[name]
    batch = generation_batch(theirs, seed=len(name), old=case.get("_old", True), ref=True)
    for t in trainers:
        configure(t, case)
    assert ours.micro_batches_follow_trl == (name in FOLLOW_TRL)
    loss, grads, parts = window(ours, batch, seed=7)
    want, want_grads, want_parts = window(theirs, batch, seed=7)
    if name in FOLLOW_TRL:  # TRL's own rows in every micro-batch
        assert _rows_of(parts, batch) == _rows_of(want_parts, batch)
    else:  # whole groups in every micro-batch
        assert all(len({r // G for r in rows}) * G == len(rows) for rows in _rows_of(parts, batch))
    assert abs(loss - want) <= 1e-5 * max(1.0, abs(want)), (loss, want)
    assert grads.keys() == want_grads.keys() and len(grads) > 10
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_generation_gives_no_sampling_logprobs_as_trls_own(trainers):
    """TRL's non-vLLM generation returns no sampling log-probs; given, TRL would use them as
    vLLM's (its off-policy mask would compare against the sampler, not the old policy)."""
    ours, theirs = trainers
    prompt = tiny_tokenizer()("a b c")["input_ids"]
    ids, logprobs = ours._generate_single_turn([prompt] * G, None, {}, G)
    assert len(ids) == G and all(len(x) >= 1 for x in ids) and logprobs is None
    _, trl_logprobs = theirs._generate_single_turn([prompt] * G, None, {}, G)
    assert trl_logprobs is None

"""polynya.adapters.trl.GRPOTrainer: 3 GRPO steps of stock TRL 1.16 on a tiny Qwen3 saved locally.

One run (module fixture) records what TRL hands the adapter; the tests then check it:
log-probs equal TRL's own implementation, each prompt prefilled once, groups whole in every
micro-batch, sampler weights equal the trainer's after every step, the reward plumbing is TRL's.
"""
from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset
from polynya.adapters.trl import GRPOTrainer
from polynya.config import SamplerConfig
from polynya.checksum import checksum_named_tensors
from polynya.models import tiny_tokenizer

from .common import save_tiny_qwen3
from polynya.sync import SyncError
from transformers import TrainerCallback

G = 4
SYSTEM = {"role": "system", "content": "You answer with a number only. Think step by step. " * 2}
QUESTIONS = ("How many apples did the farmer sell?", "What is 12 plus 7?")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory, "tiny_qwen3", 3)


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=G, gradient_accumulation_steps=2,
                num_generations=G, max_completion_length=8, max_steps=3, learning_rate=5e-3,
                logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                seed=0, beta=0.0)
    base.update(kw)
    return trl.GRPOConfig(**base)


def _dataset():
    return Dataset.from_list([{"prompt": [SYSTEM, {"role": "user", "content": q}]} for q in QUESTIONS])


def reward_digits(completions, **kwargs):
    """A TRL reward function (conversational completions): digits in the answer."""
    return [float(sum(ch.isdigit() for ch in c[0]["content"])) for c in completions]


class Recorder(TrainerCallback):
    """Added after the trainer's own weight push: sees the state right after each step."""

    def __init__(self, trainer):
        self.trainer, self.after_step = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        policy = dict(t.accelerator.unwrap_model(t.model).named_parameters())
        self.after_step.append((state.global_step, checksum_named_tensors(policy.items()),
                                t.sampler.weight_checksum(), t.sampler.stats()["weight_version"]))


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    trainer = GRPOTrainer(model_dir, reward_funcs=reward_digits, args=_args(tmp_path_factory.mktemp("out")),
                          train_dataset=_dataset(), processing_class=tiny_tokenizer(),
                          sampler_config=SamplerConfig(model_dir, dtype="float32", kv_cache_memory_gb=0.05))
    rec = Recorder(trainer)
    trainer.add_callback(rec)
    calls, gens, passes = [], [], []
    logps_fn, gen_fn = trainer._get_per_token_logps_and_entropies, trainer.sampler.generate
    policy = trainer.accelerator.unwrap_model(trainer.model)
    layer0 = [0]
    policy.model.layers[0].register_forward_pre_hook(lambda *a: layer0.__setitem__(0, layer0[0] + 1))

    def spy_logps(model, input_ids, attention_mask, logits_to_keep, **kw):
        before = layer0[0]
        out = logps_fn(model, input_ids, attention_mask, logits_to_keep, **kw)
        passes.append(layer0[0] - before)  # decoder passes inside the adapter's call
        with torch.no_grad():  # TRL's own implementation, same weights, same batch
            ref = trl.GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, model, input_ids, attention_mask, logits_to_keep, compute_entropy=True)
        calls.append((input_ids.clone(), attention_mask.clone(), logits_to_keep, kw, out, ref))
        return out

    def spy_generate(prompts, params):
        gens.append(([list(p) for p in prompts], params))
        return gen_fn(prompts, params)

    trainer._get_per_token_logps_and_entropies = spy_logps  # test instrumentation only
    trainer.sampler.generate = spy_generate
    start = trainer.sampler.stats()
    trainer.train()
    return dict(trainer=trainer, rec=rec, calls=calls, gens=gens, start=start, passes=passes,
                start_version=start["weight_version"])


def test_trains_three_steps_with_trl_plumbing(run):
    trainer = run["trainer"]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert trainer.state.global_step == 3 and len(logs) == 3
    for h in logs:  # TRL's own reward / advantage / loss bookkeeping ran on our completions
        assert "rewards/reward_digits/mean" in h and torch.isfinite(torch.tensor(h["loss"]))
        assert h["completions/mean_length"] > 0


def test_logprobs_equal_trl_base_implementation(run):
    training = [c for c in run["calls"] if c[3].get("compute_entropy")]
    assert len(training) == 6  # 3 steps x 2 micro-batches went through the adapter
    for ids, mask, keep, kw, (lp, ent, _), (ref_lp, ref_ent, _) in training:
        m = mask[:, -keep:].bool()
        assert lp.shape == ref_lp.shape == m.shape
        torch.testing.assert_close(lp.detach()[m], ref_lp[m], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent.detach()[m], ref_ent[m], atol=1e-5, rtol=1e-5)
        assert lp.requires_grad  # the loss backpropagates through polynya's log-probs


def test_no_pass_beyond_trl_own_per_step(run):
    """What a step costs besides generation, counted: with ``beta=0`` and one iteration per
    generation (as in ``bench_trl_step.py``) TRL's own trainer reuses the detached current
    log-probs as the old ones, so the adapter must make exactly one log-prob call, one decoder
    pass (entropy in the same pass) per micro-batch, and exactly one weight push per optimizer
    step — no old-log-prob pass, no second entropy pass, no repeated push."""
    calls, passes = run["calls"], run["passes"]
    assert len(calls) == 6 and all(c[3].get("compute_entropy") for c in calls)  # 3 steps x 2
    assert passes == [1] * 6
    versions = [v for *_, v in run["rec"].after_step]
    assert versions == [run["start_version"] + k for k in (1, 2, 3)]


def test_each_prompt_prefilled_once(run):
    gens, tok = run["gens"], tiny_tokenizer()
    assert len(gens) == 3
    expected = 0
    for prompts, params in gens:
        assert len(prompts) == len(QUESTIONS) and [p.n for p in params] == [G, G]
        assert len({tuple(p) for p in prompts}) == len(QUESTIONS)
        texts = [tok.decode(p) for p in prompts]
        assert all(SYSTEM["content"] in t for t in texts)
        expected += sum(len(p) for p in prompts)
    end, start = run["trainer"].sampler.stats(), run["start"]
    computed = end["prefill_tokens"] - start["prefill_tokens"]
    hits = end["cache_hit_tokens"] - start["cache_hit_tokens"]
    assert computed + hits == expected  # not G x: each prompt went in once
    assert hits > 0  # the shared system prompt's blocks were reused by the second prompt


def test_groups_whole_in_every_micro_batch(run):
    for ids, mask, keep, *_ in (c for c in run["calls"] if c[3].get("compute_entropy")):
        prompts = [tuple(r[m.bool()].tolist()) for r, m in zip(ids[:, :-keep], mask[:, :-keep])]
        counts = {p: prompts.count(p) for p in prompts}
        assert all(c % G == 0 for c in counts.values()), counts


def test_sampler_weights_equal_trainer_after_each_step(run):
    after = run["rec"].after_step
    assert [s for s, *_ in after] == [1, 2, 3]
    versions = [v for *_, v in after]
    assert versions == sorted(set(versions))  # a new push every step
    for _, trainer_sum, sampler_sum, _ in after:
        assert trainer_sum == sampler_sum
    assert len({t for _, t, _, _ in after}) == 3  # and the weights did change every step


@pytest.mark.parametrize("change, match", [
    (dict(use_vllm=True), "use_vllm"),
    (dict(repetition_penalty=1.1), "repetition_penalty"),
    (dict(per_device_train_batch_size=2, gradient_accumulation_steps=4), "multiple of num_generations"),
])
def test_refuses_settings_it_cannot_honour(model_dir, tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        GRPOTrainer(model_dir, reward_funcs=reward_digits, args=_args(tmp_path, **change),
                    train_dataset=_dataset(), processing_class=tiny_tokenizer())


def test_default_sampler_and_naive_logprobs(run, model_dir, tmp_path):
    """sampler_config=None: the policy's checkpoint, dtype and device; zorro=False still equals TRL."""
    trainer = GRPOTrainer(model_dir, reward_funcs=reward_digits, args=_args(tmp_path), zorro=False,
                          train_dataset=_dataset(), processing_class=tiny_tokenizer())
    cfg = trainer.sampler.config
    # the policy's device as accelerate names it ("cpu", or "cpu:0" once a process group exists)
    assert (cfg.model, cfg.dtype, cfg.device) == (model_dir, "float32", str(trainer.accelerator.device))
    assert torch.device(cfg.device).type == trainer.model.device.type == "cpu"
    policy = dict(trainer.model.named_parameters())
    assert trainer.sampler.weight_checksum() == checksum_named_tensors(policy.items())
    ids, mask, keep = run["calls"][0][:3]
    lp, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep,
                                                            batch_size=2, compute_entropy=True)
    with torch.no_grad():
        ref_lp, ref_ent, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, keep, compute_entropy=True)
    m = mask[:, -keep:].bool()
    torch.testing.assert_close(lp.detach()[m], ref_lp[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.detach()[m], ref_ent[m], atol=1e-5, rtol=1e-5)


def test_reference_and_old_logprobs_go_through_the_adapter(model_dir, tmp_path):
    """beta > 0 (TRL's reference model) and num_iterations=2 (old-policy log-probs, a generation
    batch reused across optimizer steps): every no-grad log-prob call equals TRL's own."""
    trainer = GRPOTrainer(model_dir, reward_funcs=reward_digits,
                          args=_args(tmp_path, beta=0.04, num_iterations=2, max_steps=2),
                          train_dataset=_dataset(), processing_class=tiny_tokenizer(),
                          sampler_config=SamplerConfig(model_dir, dtype="float32", kv_cache_memory_gb=0.05))
    inner, seen = trainer._get_per_token_logps_and_entropies, []

    def spy(model, input_ids, attention_mask, logits_to_keep, **kw):
        out = inner(model, input_ids, attention_mask, logits_to_keep, **kw)
        if not kw.get("compute_entropy"):
            with torch.no_grad():
                ref = trl.GRPOTrainer._get_per_token_logps_and_entropies(
                    trainer, model, input_ids, attention_mask, logits_to_keep)
            m = attention_mask[:, -logits_to_keep:].bool()
            torch.testing.assert_close(out[0][m], ref[0][m], atol=1e-5, rtol=1e-5)
            seen.append(model is trainer.ref_model)
        return out

    trainer._get_per_token_logps_and_entropies = spy
    trainer.train()
    assert trainer.state.global_step == 2
    assert seen.count(True) == 1 and seen.count(False) == 1  # one generation: ref + old log-probs
    assert all("kl" in h for h in trainer.state.log_history if "reward" in h)


def test_a_corrupted_push_is_refused(model_dir, tmp_path):
    trainer = GRPOTrainer(model_dir, reward_funcs=reward_digits, args=_args(tmp_path),
                          train_dataset=_dataset(), processing_class=tiny_tokenizer(),
                          sampler_config=SamplerConfig(model_dir, dtype="float32", kv_cache_memory_gb=0.05))
    load = trainer.sampler.load_weights

    def faulty(weights, version=None, **kw):  # a transport that flips one value
        weights = [(n, t.clone() if i == 0 else t) for i, (n, t) in enumerate(weights)]
        weights[0][1].view(-1)[0] += 1.0
        return load(weights, version=version, **kw)

    trainer.sampler.load_weights = faulty
    trainer.state.global_step = 1  # as after an optimizer step
    before, version = trainer.sampler.weight_checksum(), trainer.sampler.weight_version
    with pytest.raises(SyncError, match="hash"):
        trainer.push_weights()
    assert trainer._pushed_step == 0  # not marked as pushed: the next generation pushes again
    assert trainer.sampler.weight_checksum() == before  # refused before anything was copied
    assert trainer.sampler.weight_version == version


def test_push_casts_to_sampler_dtype_and_refuses_nan(model_dir, tmp_path):
    """A bf16 sampler under an fp32 policy: the push goes through the staging buffer (cast),
    the sampler then equals the policy cast to bf16; a NaN weight is refused before anything is
    copied (sampler and its version unchanged, the step not marked as pushed)."""
    trainer = GRPOTrainer(model_dir, reward_funcs=reward_digits, args=_args(tmp_path),
                          train_dataset=_dataset(), processing_class=tiny_tokenizer(),
                          sampler_config=SamplerConfig(model_dir, dtype="bfloat16", kv_cache_memory_gb=0.05))
    policy = trainer.accelerator.unwrap_model(trainer.model)

    def policy_in_bf16():
        return checksum_named_tensors([(n, p.detach().bfloat16()) for n, p in policy.named_parameters()])

    assert trainer._push.last_path == "staged"
    assert trainer.sampler.weight_checksum() == policy_in_bf16()
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.01)
    trainer.state.global_step = 1  # as after an optimizer step
    trainer.push_weights()
    assert trainer._pushed_step == 1 and trainer.sampler.weight_checksum() == policy_in_bf16()
    trainer.push_weights()  # no optimizer step since: no push
    assert len(trainer._metrics["train"]["polynya/sync_s"]) == 2
    before, version = trainer.sampler.weight_checksum(), trainer.sampler.weight_version
    with torch.no_grad():
        policy.model.layers[0].self_attn.q_proj.weight[1, 2] = float("nan")
    trainer.state.global_step = 2
    with pytest.raises(SyncError, match="NaN or inf"):
        trainer.push_weights()
    assert trainer._pushed_step == 1
    assert (trainer.sampler.weight_checksum(), trainer.sampler.weight_version) == (before, version)
    assert trainer._push._stage is not None
    for cb in trainer.callback_handler.callbacks:  # the adapter's own callback, as at train end
        if type(cb).__module__ == GRPOTrainer.__module__:
            cb.on_train_end(trainer.args, trainer.state, trainer.control)
    assert trainer._push._stage is None  # the staging buffer is freed after training


def test_bf16_autocast_error_within_twice_trl_own(run):
    """Under bf16 autocast (what TRL's ``accelerator.autocast()`` applies with ``args.bf16``),
    polynya's log-probs are as close to the fp32 values as TRL's own bf16 ones (<= 2x its error)."""
    trainer = run["trainer"]
    ids, mask, keep = run["calls"][1][:3]
    m = mask[:, -keep:].bool()
    base = trl.GRPOTrainer._get_per_token_logps_and_entropies
    with torch.no_grad():
        fp32 = base(trainer, trainer.model, ids, mask, keep)[0][m]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, keep)[0][m]
            trl_bf16 = base(trainer, trainer.model, ids, mask, keep)[0][m]
    trl_err, our_err = (trl_bf16 - fp32).abs().max(), (ours - fp32).abs().max()
    assert trl_err > 0  # TRL really computed in bf16 here
    assert our_err <= 2 * trl_err, (our_err, trl_err)

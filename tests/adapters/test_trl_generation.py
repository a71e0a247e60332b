"""The TRL adapter samples as TRL's own (non-vLLM) generation would, or refuses.

TRL's generation is transformers' ``generate`` with TRL's ``generation_config``, whose unset
fields transformers fills from the model's ``generation_config`` (the checkpoint's
``generation_config.json``). Oracle: the logits processors transformers builds for that
completed config, applied to fresh random logits; the adapter's ``SamplingParams`` through the
native sampler's own filter must keep the same tokens with the same probabilities. Settings the
sampler cannot reproduce are refused at construction, and a prompt that would leave the sampler
less than ``max_completion_length`` tokens (its ``max_model_len``) is refused before anything is
generated.
"""
from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset
from polynya.adapters.trl import GRPOTrainer
from polynya.config import SamplerConfig
from polynya.engines.sample.native.sampler import SamplingTensors, filter_logits
from polynya.models import load_model, tiny_tokenizer
from polynya.types import SamplingParams
from transformers import GenerationConfig

G, MAX_LEN = 4, 6


def _model_dir(tmp_path_factory, **generation) -> str:
    """A tiny random Qwen3 whose ``generation_config`` carries ``generation`` (as a checkpoint's
    ``generation_config.json`` would)."""
    d = tmp_path_factory.mktemp("tiny_qwen3_gen")
    model = load_model("tiny:qwen3", seed=11)
    if generation:
        model.generation_config.do_sample = True  # transformers refuses to save sampling fields otherwise
        for k, v in generation.items():
            setattr(model.generation_config, k, v)
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory)


def _trainer(model_dir, out, max_model_len=None, **args):
    base = dict(output_dir=str(out), per_device_train_batch_size=G, num_generations=G,
                max_completion_length=MAX_LEN, report_to=[], use_cpu=True, bf16=False,
                save_strategy="no", seed=0)
    config = trl.GRPOConfig(**{**base, **args})
    return GRPOTrainer(model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                       args=config, train_dataset=Dataset.from_list([{"prompt": "a b c"}] * G),
                       processing_class=tiny_tokenizer(),
                       sampler_config=SamplerConfig(model_dir, dtype="float32", kv_cache_memory_gb=0.02,
                                                    max_model_len=max_model_len))


def _trl_processors(trainer, prompt_len: int):
    """The logits processors transformers' ``generate`` applies on TRL's generation path."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    config, _ = policy._prepare_generation_config(trainer.generation_config)
    return policy._get_logits_processor(generation_config=config, input_ids_seq_length=prompt_len,
                                        device="cpu")


# (GRPOConfig settings, the model's generation_config fields)
ACCEPTED = {
    "defaults": ({}, {}),
    "temperature-top_k": (dict(temperature=0.7, top_k=5), {}),
    "top_p": (dict(top_p=0.8), {}),
    "min_p": (dict(min_p=0.1, temperature=1.3), {}),
    "top_k-top_p": (dict(top_k=40, top_p=0.6), {}),
    "top_k-min_p": (dict(top_k=7, min_p=0.2), {}),
    "min_p-from-checkpoint": ({}, dict(min_p=0.15)),  # TRL's min_p=None: transformers takes the model's
    # TRL's explicit values win over the checkpoint's: nothing filtered
    "checkpoint-filters-overridden": (dict(top_k=0), dict(top_k=20, top_p=0.95, temperature=0.6)),
}
UNFILTERED = {"defaults", "checkpoint-filters-overridden"}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_sampling_filters_equal_trl_generation(tmp_path_factory, tmp_path, name):
    args, generation = ACCEPTED[name]
    trainer = _trainer(_model_dir(tmp_path_factory, **generation), tmp_path, **args)
    params = trainer._sampling_params(G)
    assert params.n == G and params.max_tokens == MAX_LEN
    assert list(params.stop_token_ids) == list(trainer.eos_token_ids)
    filtered = assert_filters_equal_trl(trainer, params, seed=len(name))
    assert filtered == (name not in UNFILTERED)  # the other cases do filter


def assert_filters_equal_trl(trainer, params: SamplingParams, seed: int) -> bool:
    """The sampler's filter with ``params`` keeps the tokens transformers' logits processors for
    the trainer's generation config keep, with the same probabilities, on fresh random logits;
    returns whether any token was removed."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    logits = torch.randn(6, vocab, generator=g) * 4  # peaked enough that every filter removes tokens
    input_ids = torch.randint(5, vocab, (6, 9), generator=g)
    want = _trl_processors(trainer, 9)(input_ids, logits.clone())
    st = SamplingTensors.build([params] * 6, [0.5] * 6, vocab, "cpu")
    got = filter_logits(logits, st)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1), atol=1e-6, rtol=1e-5)
    return not bool(torch.isfinite(want).all())


def test_min_p_after_top_p_is_refused_and_would_differ(plain_dir, tmp_path):
    """transformers filters top-p and then min-p; the sampler (vLLM's order) min-p first: on
    probabilities (0.4, 0.3, 0.2, 0.1), top_p=0.75 and min_p=0.3 keep three tokens in
    transformers and two in the sampler."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    model = load_model("tiny:qwen3", seed=0)
    hf = model._get_logits_processor(GenerationConfig(do_sample=True, top_p=0.75, min_p=0.3), device="cpu")
    want = hf(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    st = SamplingTensors.build([SamplingParams(top_p=0.75, min_p=0.3)], [0.5], 4, "cpu")
    assert torch.isfinite(want).sum() == 3 and torch.isfinite(filter_logits(logits, st)).sum() == 2
    with pytest.raises(ValueError, match="min_p=0.3 together with top_p=0.75"):
        _trainer(plain_dir, tmp_path, top_p=0.75, min_p=0.3)


@pytest.mark.parametrize("field, value", [
    ("no_repeat_ngram_size", 3), ("suppress_tokens", [7, 8]), ("typical_p", 0.9),
    ("bad_words_ids", [[9]]), ("num_return_sequences", 2),
])
def test_refuses_processors_inherited_from_the_checkpoint(tmp_path_factory, tmp_path, field, value):
    """TRL leaves these unset; transformers then applies the checkpoint's value, which the native
    sampler has no counterpart for."""
    model_dir = _model_dir(tmp_path_factory, **{field: value})
    with pytest.raises(ValueError, match=f"{field}="):
        _trainer(model_dir, tmp_path)


def test_refuses_completions_the_sampler_would_cut(plain_dir, tmp_path):
    """TRL's generation keeps sampling up to ``max_completion_length``; the sampler stops at its
    ``max_model_len``. A sampler that cannot hold ``max_completion_length`` is refused at
    construction; a prompt too long for the rest is refused before anything is generated. A
    later turn of a tool-calling rollout (prompt + completion + tool result) is not checked:
    TRL keeps only what is left of ``max_completion_length`` of it, which fits."""
    with pytest.raises(ValueError, match="max_completion_length=6 exceeds the sampler's max_model_len=6"):
        _trainer(plain_dir, tmp_path, max_model_len=MAX_LEN)
    trainer = _trainer(plain_dir, tmp_path, max_model_len=12)
    tok = tiny_tokenizer()
    fits, too_long = "a b c d", "a b c d e f g"
    assert len(tok(fits)["input_ids"]) <= 12 - MAX_LEN < len(tok(too_long)["input_ids"])
    before = trainer.sampler.stats()["requests"]
    with pytest.raises(ValueError, match=r"prompt of \d+ tokens plus max_completion_length=6"):
        trainer._generate([fits] * G + [too_long] * G)
    assert trainer.sampler.stats()["requests"] == before  # nothing was generated
    prompt_ids, completion_ids, *_ = trainer._generate([fits] * G)
    assert len(completion_ids) == G and trainer.sampler.stats()["requests"] == before + 1
    later_turn = prompt_ids[0] + completion_ids[0][:2] + [5]  # as TRL's tool loop sends it
    ids, _ = trainer._generate_single_turn([later_turn], None, {}, 1)
    assert len(ids) == 1 and 1 <= len(ids[0]) <= 12 - len(later_turn)


def test_refuses_a_sampler_checkpoint_configured_unlike_the_policy(plain_dir, tmp_path):
    """A config field given in ``model_init_kwargs`` is in the policy, not in the checkpoint the
    sampler loads: same weights, another model (here RoPE's positions halved). Refused; the
    settings that do not change the model's numbers (dtype, attention backend) are not."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ids = torch.randint(5, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = load_model(plain_dir)(ids).logits
        scaled = load_model(plain_dir, rope_parameters=rope)(ids).logits
    assert (plain - scaled).abs().max() > 1e-3  # the override changes what the policy computes
    with pytest.raises(ValueError, match=r"rope_parameters: .*'linear'.* != "):
        _trainer(plain_dir, tmp_path, model_init_kwargs={"rope_parameters": rope})
    trainer = _trainer(plain_dir, tmp_path, bf16=True,
                       model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "eager"})
    assert trainer.accelerator.unwrap_model(trainer.model).dtype == torch.bfloat16

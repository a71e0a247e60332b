"""``GRPOConfig.generation_kwargs`` on the TRL adapter: honoured as in TRL's own generation, or
refused.

TRL's own (non-vLLM) generation merges ``generation_kwargs`` over its settings into the
``GenerationConfig`` it passes to transformers' ``generate`` (``generation_kwargs`` win; a
``None`` there unsets TRL's value, so transformers takes the checkpoint's). Oracles: transformers'
logits processors for that config on fresh random logits (``assert_filters_equal_trl``), and TRL's
own ``_generate_single_turn`` on the same weights for the deterministic cases (greedy, ``top_k=1``,
``max_new_tokens``, ``min_new_tokens`` against an EOS the model would pick first). Keys the
sampler cannot reproduce, and unknown keys, are refused at construction, naming each key and
why, with no sampler built.
"""
from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")
import polynya.adapters.trl.trainer as trainer_module
from polynya.models import load_model, tiny_tokenizer
from transformers import GenerationConfig

from .test_trl_generation import MAX_LEN, G, _model_dir, _trainer, assert_filters_equal_trl

INERT = {"repetition_penalty": 1.0, "num_beams": 1, "use_cache": False, "pad_token_id": 1,
         "bos_token_id": 2, "output_scores": True, "output_logits": True, "renormalize_logits": True,
         "return_dict_in_generate": False, "suppress_tokens": [],
         "eos_token_id": 0}  # TRL's EOS ids here: the tokenizer's
# name: (GRPOConfig settings, generation_kwargs, the checkpoint's generation_config, the
# SamplingParams fields the sampler must get)
TRANSLATED = {
    "temperature": ({"temperature": 0.9}, {"temperature": 0.5}, {}, {"temperature": 0.5}),
    "top_p": ({"top_p": 0.9}, {"top_p": 0.7}, {}, {"top_p": 0.7}),
    "top_k": ({"top_k": 5}, {"top_k": 3}, {}, {"top_k": 3}),
    "top_k-off": ({"top_k": 5}, {"top_k": 0}, {}, {"top_k": -1}),
    "min_p": ({"min_p": 0.05}, {"min_p": 0.2}, {}, {"min_p": 0.2}),
    # None unsets TRL's min_p: transformers takes the checkpoint's
    "min_p-none": ({"min_p": 0.05}, {"min_p": None}, {"min_p": 0.15}, {"min_p": 0.15}),
    "do_sample-false": ({"temperature": 0.7, "top_k": 5, "min_p": 0.1}, {"do_sample": False}, {},
                        {"temperature": 0.0, "top_k": -1, "min_p": 0.0}),
    "max_new_tokens": ({}, {"max_new_tokens": 3}, {}, {"max_tokens": 3}),
    "min_new_tokens": ({}, {"min_new_tokens": 2}, {}, {"min_tokens": 2}),
    "min_new_tokens-past-max": ({}, {"min_new_tokens": 50}, {}, {"min_tokens": MAX_LEN}),
    # inherited from the checkpoint (TRL leaves it unset)
    "min_new_tokens-checkpoint": ({}, {}, {"min_new_tokens": 4}, {"min_tokens": 4}),
    # no effect on the sampled tokens, or off (generation_kwargs' 1.0 overrides GRPOConfig's 1.3)
    "inert": ({"repetition_penalty": 1.3}, INERT, {},
              {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": MAX_LEN,
               "min_tokens": 0}),
}


@pytest.mark.parametrize("name", list(TRANSLATED))
def test_translated_keys_reach_the_sampler_with_trl_precedence(tmp_path_factory, tmp_path, name):
    args, kwargs, generation, expected = TRANSLATED[name]
    model_dir = _model_dir(tmp_path_factory, **generation)
    trainer = _trainer(model_dir, tmp_path, generation_kwargs=kwargs, **args)
    params = trainer._sampling_params(G)
    assert {k: getattr(params, k) for k in expected} == pytest.approx(expected)
    assert list(params.stop_token_ids) == list(trainer.eos_token_ids)
    assert trainer.temperature == args.get("temperature", 1.0)  # log-probs keep TRL's, as TRL's own
    if params.temperature > 0:  # greedy: the generation tests below
        filtered = assert_filters_equal_trl(trainer, params, seed=len(name))
        assert filtered == (params.top_p < 1 or params.min_p > 0 or params.top_k != -1)


PROMPTS = [[5, 6, 7, 8]] * G + [[9, 10, 11, 12]] * G  # one length: no padding in TRL's batch


def _both(trainer) -> tuple[list, list]:
    """(the adapter's completions, TRL's own generation's) for ``PROMPTS``, same weights."""
    ours, _ = trainer._generate_single_turn(PROMPTS, None, {}, G)
    theirs, _ = trl.GRPOTrainer._generate_single_turn(trainer, PROMPTS, None, {}, G)
    return ours, theirs


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def greedy(plain_dir, tmp_path_factory):
    """TRL's own greedy completions of ``PROMPTS`` (``do_sample=False``) and the adapter's."""
    out = tmp_path_factory.mktemp("out")
    return _both(_trainer(plain_dir, out, generation_kwargs={"do_sample": False}))


def test_greedy_equals_trl_generation(greedy):
    ours, theirs = greedy
    assert ours == theirs
    assert len({tuple(c) for c in theirs}) == 2  # one completion per prompt, G times
    assert all(len(c) == MAX_LEN for c in theirs)  # no EOS from this model: all tokens compared


def test_inert_keys_leave_trl_generation_as_the_adapter(plain_dir, tmp_path, greedy):
    """The accepted no-effect keys: TRL's own greedy generation with them gives the completions
    it gives without them, and so does the adapter."""
    trainer = _trainer(plain_dir, tmp_path, generation_kwargs={**INERT, "do_sample": False})
    ours, theirs = _both(trainer)
    assert ours == theirs == greedy[1]


def test_top_k_1_samples_greedy(plain_dir, tmp_path, greedy):
    """Sampling (TRL's ``do_sample=True``) with ``top_k=1`` from ``generation_kwargs`` over
    ``GRPOConfig.top_k``: the greedy completions, in TRL's own generation and in the adapter's."""
    trainer = _trainer(plain_dir, tmp_path, top_k=40, temperature=0.8,
                       generation_kwargs={"top_k": 1})
    params = trainer._sampling_params(1)
    assert (params.top_k, params.temperature) == (1, 0.8)
    ours, theirs = _both(trainer)
    assert ours == theirs == greedy[1]


def test_max_new_tokens_equals_trl_generation(plain_dir, tmp_path, greedy):
    kwargs = {"do_sample": False, "max_new_tokens": 3}
    ours, theirs = _both(_trainer(plain_dir, tmp_path, generation_kwargs=kwargs))
    assert ours == theirs == [c[:3] for c in greedy[1]]


def test_max_new_tokens_needs_room_in_the_sampler(plain_dir, tmp_path):
    """``max_new_tokens`` above ``max_completion_length`` is what the sampler must hold; below,
    ``max_completion_length`` still is (what a tool-calling rollout's completion keeps)."""
    small = _trainer(plain_dir, tmp_path, max_model_len=8, generation_kwargs={"max_new_tokens": 2})
    with pytest.raises(ValueError, match=r"prompt of 4 tokens plus max_completion_length=6"):
        small._tokenize_prompts(["a b c d"])
    kwargs = {"do_sample": False, "max_new_tokens": 10}
    trainer = _trainer(plain_dir, tmp_path, max_model_len=12, generation_kwargs=kwargs)
    with pytest.raises(ValueError, match=r"prompt of 4 tokens plus generation_kwargs "
                                         r"max_new_tokens=10 exceeds the sampler's max_model_len=12"):
        trainer._tokenize_prompts(["a b c d"])  # 4 tokens
    ours, theirs = _both(_trainer(plain_dir, tmp_path, generation_kwargs=kwargs))
    assert ours == theirs and all(len(c) == 10 for c in ours)


def test_min_new_tokens_bans_eos_as_trl_generation(greedy, tmp_path_factory, tmp_path):
    """A checkpoint whose EOS is the token greedy decoding picks first: without
    ``min_new_tokens`` every completion is that token alone; with ``min_new_tokens=3`` it is
    banned for three tokens, in TRL's own generation and in the adapter's alike."""
    first = {c[0] for c in greedy[1]}
    model_dir = _model_dir(tmp_path_factory, eos_token_id=sorted(first))
    stop = _trainer(model_dir, tmp_path, generation_kwargs={"do_sample": False})
    assert set(stop.eos_token_ids) == first | {tiny_tokenizer().eos_token_id}
    ours, theirs = _both(stop)
    assert ours == theirs == [c[:1] for c in greedy[1]]
    kwargs = {"do_sample": False, "min_new_tokens": 3}
    banned = _trainer(model_dir, tmp_path, generation_kwargs=kwargs)
    assert banned._sampling_params(1).min_tokens == 3
    ours, theirs = _both(banned)
    assert ours == theirs
    assert all(len(c) >= 4 for c in ours)  # MAX_LEN = 6
    assert not any(t in banned.eos_token_ids for c in ours for t in c[:3])


# generation_kwargs -> what the error must say. Refused before TRL builds anything:
BEFORE_TRL = {
    "repetition_penalty": ({"repetition_penalty": 1.2},
                           ["generation_kwargs repetition_penalty=1.2 (a logits processor"]),
    "no_repeat_ngram_size": ({"no_repeat_ngram_size": 2},
                             ["no_repeat_ngram_size=2 (a logits processor"]),
    "num_beams": ({"num_beams": 2}, ["num_beams=2 (beam search)"]),
    "num_return_sequences": ({"num_return_sequences": 2},
                             ["num_return_sequences=2 (more completions"]),
    "return_dict_in_generate": ({"return_dict_in_generate": True},
                                ["return_dict_in_generate=True (TRL's"]),
    "min_length": ({"min_length": 3}, ["min_length=3 (transformers counts it from the left-padded"]),
    "max_length": ({"max_length": 30}, ["max_length=30 (a total length"]),
    "typical_p": ({"typical_p": 0.5}, ["typical_p=0.5 (a sampling filter"]),
    "stop_strings": ({"stop_strings": ["."]}, ["stop_strings=['.'] (a stopping criterion"]),
    # vLLM's names and other unknown keys: transformers would keep and ignore them
    "unknown": ({"min_tokens": 2, "stop_token_ids": [5], "seed": 3, "output_attentions": True},
                [f"generation_kwargs {k}=" for k in ("min_tokens", "stop_token_ids", "seed",
                                                     "output_attentions")]
                + ["not a generation setting the adapter translates"]),
}
# refused once TRL has merged them into its generation config, before the sampler is built
AFTER_TRL = {
    "eos_token_id": ({"eos_token_id": [5]}, ["eos_token_id=[5] (TRL cuts completions at [0]"]),
    "max_new_tokens-none": ({"max_new_tokens": None}, ["max_new_tokens=None (an int >= 1"]),
    "min_new_tokens-negative": ({"min_new_tokens": -1}, ["min_new_tokens=-1 (an int >= 0)"]),
    "temperature-zero": ({"temperature": 0.0}, ["temperature=0.0 with do_sample=True"]),
    "top_k-negative": ({"top_k": -1}, ["top_k=-1 (transformers refuses a negative top_k"]),
    "min_p-top_p": ({"min_p": 0.1, "top_p": 0.8}, ["min_p=0.1 together with top_p=0.8"]),
}


@pytest.fixture
def built(monkeypatch) -> dict:
    """How many TRL trainers (``trl.GRPOTrainer.__init__``) and samplers the test builds."""
    counts = {"trl": 0, "sampler": 0}
    trl_init, engine = trl.GRPOTrainer.__init__, trainer_module.SamplingEngine

    def counting_init(self, *a, **kw):
        counts["trl"] += 1
        trl_init(self, *a, **kw)

    def counting_engine(*a, **kw):
        counts["sampler"] += 1
        return engine(*a, **kw)

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", counting_init)
    monkeypatch.setattr(trainer_module, "SamplingEngine", counting_engine)
    return counts


@pytest.mark.parametrize("name", list(BEFORE_TRL) + list(AFTER_TRL))
def test_refused_keys_are_named_and_nothing_is_built(plain_dir, tmp_path, built, name):
    kwargs, needles = {**BEFORE_TRL, **AFTER_TRL}[name]
    with pytest.raises(ValueError) as err:
        _trainer(plain_dir, tmp_path, generation_kwargs=kwargs)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert built == {"trl": 0 if name in BEFORE_TRL else 1, "sampler": 0}
    _trainer(plain_dir, tmp_path)  # the counters do see a construction that goes through
    assert built == {"trl": 1 if name in BEFORE_TRL else 2, "sampler": 1}


def test_transformers_refuses_or_ignores_what_the_adapter_refuses():
    """What the refusals above say of transformers: it refuses ``temperature=0`` and a negative
    ``top_k`` while sampling (TRL's generation would fail at its first step), and keeps vLLM's
    key names on the config without applying them."""
    model = load_model("tiny:qwen3", seed=0)
    for bad in ({"temperature": 0.0}, {"top_k": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            model._get_logits_processor(GenerationConfig(do_sample=True, **bad), device="cpu")
    vllm_names = GenerationConfig(do_sample=True, top_k=0, min_tokens=2, stop_token_ids=[5],
                                  seed=3)
    assert vllm_names.min_tokens == 2
    assert len(model._get_logits_processor(vllm_names, device="cpu")) == 0


def test_inherited_repetition_penalty_is_refused(tmp_path_factory, tmp_path):
    """``repetition_penalty=None`` in generation_kwargs unsets TRL's 1.0: transformers applies
    the checkpoint's, which the sampler cannot."""
    model_dir = _model_dir(tmp_path_factory, repetition_penalty=1.3)
    _trainer(model_dir, tmp_path)  # TRL's explicit 1.0 wins over the checkpoint's
    with pytest.raises(ValueError, match=r"repetition_penalty=1.3 \(a logits processor"):
        _trainer(model_dir, tmp_path, generation_kwargs={"repetition_penalty": None})

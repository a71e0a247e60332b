"""The model-family matrix on CPU: ZoRRo == naive for every family polynya claims, or a clear
refusal at load time (fp32, tiny random models, windows shorter than the shared prompts).

The naive reference is transformers' own eager attention on a second copy of the same weights
(its sliding-window masks, soft-caps and query scales), so the matrix checks polynya against
transformers, not against itself. Each batch shares a system prompt longer than the sliding
window, and responses run past the window too.
"""
import random

import pytest
import torch
from polynya import RolloutBatch, compute_logprobs
from polynya.model_features import attention_features
from polynya.models import TINY_SLIDING_WINDOW, load_model

ZORRO_FAMILIES = ["llama", "qwen2", "qwen3", "qwen3-moe", "mistral", "gemma2", "gemma3", "phi3",
                  "olmo2", "qwen2-window"]
REFUSED = {"gpt-oss": "ZoRRo Train does not implement attention sinks, which tiny:gpt-oss "
                      "(gpt_oss) uses; call compute_logprobs(..., zorro=False) (TrainConfig / "
                      "LogProbConfig zorro=False) for this model"}


def window_batch(seed: int, vocab: int, *, system: int = 2 * TINY_SLIDING_WINDOW - 3,
                 groups: int = 4) -> RolloutBatch:
    """Groups sharing one system prompt longer than the window, ragged questions and responses
    (some responses longer than the window), one group without the system prompt, shuffled."""
    rng = random.Random(seed)
    sys_ids = [rng.randrange(2, vocab) for _ in range(system)]
    prompts, responses = [], []
    for g in range(groups):
        q = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 9))]
        prompt = q if g == groups - 1 else sys_ids + q
        for _ in range(rng.randint(1, 4)):
            prompts.append(prompt)
            responses.append([rng.randrange(2, vocab) for _ in range(rng.randint(1, 14))])
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return RolloutBatch([prompts[i] for i in order], [responses[i] for i in order])


def _stats_and_grads(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    st = compute_logprobs(model, batch, entropy=True, **kw)
    w = torch.linspace(-1, 1, st.logprobs.numel()).view_as(st.logprobs)
    ((st.logprobs * w).sum() + 0.3 * (st.entropy * st.mask).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return st, grads


@pytest.mark.parametrize("family", ZORRO_FAMILIES)
def test_zorro_equals_transformers_eager(family):
    spec = f"tiny:{family}"
    ref = load_model(spec, seed=3, attn_implementation="eager")
    model = load_model(spec, seed=3)
    batch = window_batch(len(family), model.config.vocab_size)
    assert max(p.size + r.size for p, r in zip(batch.prompts, batch.responses)) > 2 * TINY_SLIDING_WINDOW
    naive, g_naive = _stats_and_grads(ref, batch, zorro=False, naive_layout="padded")
    assert ref.config._attn_implementation == "eager"  # the reference stayed transformers' own
    for kw in (dict(zorro=True, max_tokens_per_row=48), dict(zorro=False, naive_layout="packed"),
               dict(zorro=False, naive_layout="packed", max_tokens_per_row=40)):
        z, g_zorro = _stats_and_grads(model, batch, chunk_size=11, **kw)
        assert torch.equal(z.mask, naive.mask)
        torch.testing.assert_close(z.logprobs, naive.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(z.entropy, naive.entropy, atol=1e-5, rtol=0)
        assert g_naive.keys() == g_zorro.keys() and len(g_naive) > 0
        for name, g in g_naive.items():
            rel = (g_zorro[name] - g).norm() / g.norm().clamp_min(1e-12)
            assert rel < 1e-4, f"{family} {kw} {name}: relative grad error {rel:.2e}"
    # the same (switched) model's padded naive path still equals transformers' eager
    again = compute_logprobs(model, batch, zorro=False, naive_layout="padded", entropy=True)
    torch.testing.assert_close(again.logprobs, naive.logprobs, atol=1e-5, rtol=0)


WITHOUT = {"mistral": dict(sliding_window=None), "qwen2-window": dict(use_sliding_window=False),
           "phi3": dict(sliding_window=None),
           "gemma2": dict(layer_types=["full_attention"] * 2),
           "gemma2-softcap": dict(attn_logit_softcapping=None)}


@pytest.mark.parametrize("case", sorted(WITHOUT))
def test_ignoring_the_feature_would_show(case):
    """The matrix can fail: without its window / soft-cap the tiny model's numbers move."""
    spec = "tiny:" + case.removesuffix("-softcap")
    model = load_model(spec, seed=3, attn_implementation="eager")
    batch = window_batch(1, model.config.vocab_size)
    with torch.no_grad():
        base = compute_logprobs(model, batch, zorro=False, naive_layout="padded").logprobs
        plain = load_model(spec, seed=3, attn_implementation="eager", **WITHOUT[case])
        moved = compute_logprobs(plain, batch, zorro=False, naive_layout="padded").logprobs
    assert (base - moved).abs().max() > 1e-3


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_family_is_refused_and_naive_still_runs(family):
    model = load_model(f"tiny:{family}", seed=0)
    batch = window_batch(0, model.config.vocab_size)
    before = model.config._attn_implementation
    with pytest.raises(ValueError) as err:
        compute_logprobs(model, batch, zorro=True)
    assert str(err.value) == REFUSED[family]
    assert model.config._attn_implementation == before  # nothing switched
    naive = compute_logprobs(model, batch, zorro=False, entropy=True)  # auto: padded
    assert torch.isfinite(naive.logprobs[naive.mask]).all()
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="packed naive layout does not implement .* use "
                                         "naive_layout='padded'"):
        compute_logprobs(model, batch, zorro=False, naive_layout="packed")
    assert model.config._attn_implementation == before


def test_features_are_read_from_transformers_layer_types():
    f = attention_features(load_model("tiny:gemma3", seed=0).config)
    assert f.layer_windows == (TINY_SLIDING_WINDOW, None) and f.final_softcap == 5.0
    assert f.query_scale == pytest.approx(24 ** -0.5)
    q = attention_features(load_model("tiny:qwen2-window", seed=0).config)
    assert q.layer_windows == (None, TINY_SLIDING_WINDOW)  # max_window_layers=1: layer 1 slides
    m = attention_features(load_model("tiny:mistral", seed=0).config)
    assert m.layer_windows == (TINY_SLIDING_WINDOW,) * 2
    g = attention_features(load_model("tiny:gemma2", seed=0))
    assert g.attn_softcap == 2.0 and g.needs() == ["sliding-window attention", "attention soft-capping"]
    assert attention_features(load_model("tiny:gpt-oss", seed=0)).sinks
    plain = attention_features(load_model("tiny:qwen3", seed=0))
    assert plain.needs() == [] and plain.layer_windows == (None, None)


def test_a_misread_window_is_an_error_not_a_number():
    f = attention_features(load_model("tiny:mistral", seed=0).config)
    with pytest.raises(ValueError, match="sliding_window=5 but its config reads as 8"):
        f.check_call(0, {"sliding_window": 5})
    with pytest.raises(ValueError, match="no valid layer_idx"):
        f.check_call(None, {"sliding_window": 8})
    assert f.check_call(1, {"sliding_window": 8}) == 8
    plain = attention_features(load_model("tiny:qwen3", seed=0).config)
    assert plain.check_call(None, {}) is None  # no windows: a module without layer_idx is fine
    with pytest.raises(ValueError, match="sliding_window=8 but its config reads as None"):
        plain.check_call(0, {"sliding_window": 8})
    with pytest.raises(ValueError, match="softcap=3.0"):
        plain.check_call(0, {"softcap": 3.0})


def test_engines_refuse_at_load_what_they_cannot_honour():
    """``check_model`` is what TrainingEngine / LogProbEngine run right after loading."""
    from polynya.logprobs import check_model

    oss = load_model("tiny:gpt-oss", seed=0)
    with pytest.raises(ValueError) as err:
        check_model(oss, zorro=True)
    assert str(err.value) == REFUSED["gpt-oss"]
    assert check_model(oss, zorro=False).sinks  # auto: the padded naive path runs transformers' own
    with pytest.raises(ValueError, match="attention sinks"):
        check_model(oss, zorro=False, naive_layout="packed")
    moe = load_model("tiny:qwen3-moe", seed=0, output_router_logits=True)
    assert check_model(moe, zorro=True).router_aux_loss  # log-probs: no loss involved
    with pytest.raises(ValueError, match="output_router_logits=True .* set output_router_logits=False"):
        check_model(moe, zorro=True, train=True)
    assert not check_model(load_model("tiny:gemma2", seed=0), zorro=True, train=True).sinks


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral"])
def test_naive_path_equals_the_full_hf_model(family):
    """compute_logprobs runs the base model + its own LM head (final soft-cap included): equal to
    the log-softmax of transformers' full forward, sample by sample."""
    model = load_model(f"tiny:{family}", seed=5, attn_implementation="eager")
    batch = window_batch(4, model.config.vocab_size, groups=2)
    st = compute_logprobs(model, batch, zorro=False, naive_layout="padded", temperature=0.7)
    for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
        ids = torch.tensor([list(p) + list(r)])
        with torch.no_grad():
            logits = model(ids).logits[0, p.size - 1:-1].float() / 0.7
        ref = logits.log_softmax(-1).gather(1, torch.tensor(r)[:, None])[:, 0]
        torch.testing.assert_close(st.logprobs[i, :r.size].detach(), ref, atol=1e-5, rtol=0)


def test_attention_dropout_is_refused_where_it_would_apply(tmp_path):
    """polynya's attention paths do not all apply attention dropout (ZoRRo's segments, the packed
    naive layout, the GPU kernels): in train mode it would make log-probs depend on the batch
    layout, so training refuses it by name; eval (the log-prob engine) has no dropout."""
    from polynya import RolloutBatch, compute_logprobs
    from polynya.config.train import TrainConfig
    from polynya.engines.train import TrainingEngine
    from polynya.models import load_model

    model = load_model("tiny:qwen3", dtype="float32")
    model.config.attention_dropout = 0.1
    batch = RolloutBatch([[5, 6, 7]] * 2, [[8, 9], [10]])
    eval_lp = compute_logprobs(model.eval(), batch).logprobs  # no dropout in eval: accepted
    assert torch.isfinite(eval_lp).all()
    with pytest.raises(ValueError, match="attention_dropout=0.1.*set attention_dropout=0.0"):
        compute_logprobs(model.train(), batch)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        TrainingEngine(TrainConfig(str(tmp_path), dtype="float32", zero_stage=0))

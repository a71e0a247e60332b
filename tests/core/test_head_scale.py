"""Models whose causal-LM forward scales the LM head's logits (Granite divides by
``logits_scaling``, Cohere multiplies by ``logit_scale``): polynya's own head paths
(``compute_logprobs``, every layout; the sampler's prompt log-probs) give the model's own
log-probs, and a scale polynya cannot place is refused instead of dropped.

(Before: the head computed ``log_softmax(lm_head(h) / T)`` for every model, so a Granite
model's log-probs were taken at 8x its temperature — without an error.)
"""
import pytest
import torch
import transformers
from polynya import RolloutBatch, compute_logprobs
from polynya.model_features import attention_features

# head dim 16: the smallest FlexAttention takes on CUDA (the GPU variants below)
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _model(kind: str):
    """A tiny random model whose head is scaled up, so that its logits are far from uniform and
    the model's own scale changes every log-prob noticeably."""
    torch.manual_seed(0)
    if kind == "granite":
        cfg = transformers.GraniteConfig(**TINY, logits_scaling=8.0, attention_multiplier=0.2,
                                         embedding_multiplier=3.0, residual_multiplier=0.5)
        model = transformers.GraniteForCausalLM(cfg)
    else:
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**TINY, logit_scale=0.0625))
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    return model.eval()


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 96, (7,), generator=g).tolist()
    responses = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (5, 3, 6)]
    return RolloutBatch([prompt] * 3, responses)


def _reference(model, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """The model's own forward, one sample at a time: log-softmax of its logits / T (on the
    model's device; returned on the CPU)."""
    out = torch.zeros(len(batch), batch.max_response_len)
    dev = next(model.parameters()).device
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
            ids = torch.tensor([list(p) + list(r)], device=dev)
            logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
            n = len(p)
            out[i, :len(r)] = logp[n - 1:n - 1 + len(r)].gather(-1, ids[0, n:, None])[:, 0].cpu()
    return out


@pytest.mark.parametrize("kind,scale", [("granite", 1 / 8), ("cohere", 0.0625)])
def test_features_read_the_scale(kind, scale):
    assert attention_features(_model(kind)).logit_scale == pytest.approx(scale)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("layout", ["zorro", "packed", "padded"])
@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_logprobs_equal_the_models_own(kind, layout, temperature, device="cpu"):
    model, batch = _model(kind).to(device), _batch()
    kw = {"zorro": True} if layout == "zorro" else {"zorro": False, "naive_layout": layout}
    with torch.no_grad():
        got = compute_logprobs(model, batch, temperature=temperature, **kw)
    want = _reference(model, batch, temperature)
    mask = batch.response_mask()
    tol = 2e-5 if device == "cpu" else 1e-4  # CUDA: other kernels, other summation orders
    torch.testing.assert_close(got.logprobs.cpu()[mask], want[mask], atol=tol, rtol=0)
    unscaled = _reference(model, batch, temperature / attention_features(model).logit_scale)
    assert (unscaled - want)[mask].abs().max() > 0.05  # the scale matters on this model


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["zorro", "packed"])
@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_logprobs_equal_the_models_own_on_the_gpu(kind, layout):
    """The same on CUDA (fp32 model): the scale reaches the fused and compiled head paths."""
    test_logprobs_equal_the_models_own(kind, layout, 0.7, device="cuda")


def test_a_scale_polynya_cannot_place_is_refused():
    cfg = transformers.LlamaConfig(**TINY)
    cfg.logits_scaling = 8.0  # a llama's forward ignores it; polynya cannot know that in general
    with pytest.raises(ValueError, match="llama sets logits_scaling=8.0"):
        attention_features(transformers.LlamaForCausalLM(cfg))
    cfg.logits_scaling = 1.0
    assert attention_features(transformers.LlamaForCausalLM(cfg)).logit_scale is None


def test_a_bad_scale_is_refused():
    cfg = transformers.GraniteConfig(**TINY, logits_scaling=0.0)
    with pytest.raises(ValueError, match="logits_scaling must be a positive finite number"):
        attention_features(cfg)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampler_prompt_logprobs_equal_the_models_own(tmp_path, device):
    """The native sampler's scoring path (``SamplingEngine.prompt_logprobs``) on a saved Granite
    model: the model's own log-probs at the requested temperature."""
    from polynya.config import SamplerConfig
    from polynya.engines import SamplingEngine

    model = _model("granite")
    model.save_pretrained(tmp_path)
    engine = SamplingEngine(SamplerConfig(str(tmp_path), dtype="float32", device=device,
                                          block_size=4, num_blocks=32, seed=0))
    batch = _batch()
    seqs = [list(p) + list(r) for p, r in zip(batch.prompts, batch.responses)]
    out = engine.prompt_logprobs(seqs, top_k=0, temperature=0.7)
    for seq, got in zip(seqs, out):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float() / 0.7, -1)
        want = logp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.as_tensor(got.logprobs, dtype=torch.float32), want,
                                   atol=2e-5 if device == "cpu" else 1e-4, rtol=0)

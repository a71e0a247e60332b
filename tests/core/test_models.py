import pytest
import torch

from polynya.models import TINY_VOCAB, load_model, load_tokenizer, model_config, tiny_tokenizer


@pytest.mark.parametrize("spec", ["tiny:qwen3", "tiny:llama", "tiny:qwen3-moe"])
def test_tiny_models_are_seeded_and_match_the_tokenizer(spec):
    a, b = load_model(spec, seed=3), load_model(spec, seed=3)
    c = load_model(spec, seed=4)
    assert a.config.vocab_size == TINY_VOCAB == len(tiny_tokenizer())
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    out = a(torch.tensor([[3, 4, 5]])).logits
    assert out.shape == (1, 3, TINY_VOCAB) and torch.isfinite(out).all()


def test_tokenizer_round_trip_and_specials():
    tok = load_tokenizer("tiny:qwen3")
    text = "Natalia sold 48 clips #### 72 SELECT name FROM t; \\boxed{7} é"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == model_config("tiny:qwen3").eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_random_shape_config_is_real_size():
    cfg = model_config("random:qwen3-0.6b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (1024, 28, 151936)


@pytest.mark.parametrize("spec", ["tiny:gpt7", "random:huge", "no-such-model"])
def test_unknown_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        load_model(spec)


@pytest.mark.parametrize("spec", ["tiny:qwen3", "tiny:gemma3"])
def test_synthetic_bf16_models_keep_float32_rope_like_their_export(spec, tmp_path):
    """RoPE frequencies stay float32 in a bf16 model, as from_pretrained keeps them: the model
    and its own save_pretrained export compute the same logits (a bf16 copy of the frequencies
    put them 2e-3 apart in log-prob)."""
    from transformers import AutoModelForCausalLM

    model = load_model(spec, dtype="bfloat16")
    rope = {n: b.dtype for n, b in model.named_buffers() if n.endswith("inv_freq")}
    assert rope and set(rope.values()) == {torch.float32}, rope
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids = torch.randint(4, TINY_VOCAB, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)

"""The Hugging Face export of a trained engine: ``save_pretrained`` (and ``save``'s ``hf/``) loads
with plain transformers and gives the trainer's own log-probs."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import polynya
from polynya.engines.train import HF_EXPORT, TrainingEngine
from polynya.models import load_tokenizer

from .common import make_batch, train_config


@pytest.mark.parametrize("stage", [0, 3])
def test_export_loads_in_transformers_with_the_trainers_logprobs(stage, tmp_path):
    engine = TrainingEngine(train_config(stage, loss="dapo", lr=5e-2))
    batch = make_batch(5)
    for _ in range(2):  # move the weights away from their initialisation
        engine.forward_backward(batch)
        engine.step()
    engine.save(str(tmp_path / "ckpt"))
    path = tmp_path / "ckpt" / HF_EXPORT
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(path))

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config._attn_implementation != "polynya"  # loads without polynya's hook
    want = engine.compute_logprobs(batch)
    with torch.no_grad():
        got = polynya.compute_logprobs(model, batch, zorro=False)
    torch.testing.assert_close(got.logprobs, want.logprobs.cpu(), rtol=1e-5, atol=1e-5)
    assert (got.logprobs - polynya.compute_logprobs(
        polynya.models.load_model("tiny:qwen3", dtype="float32"), batch, zorro=False).logprobs.detach()
            ).abs().max() > 1e-3  # trained weights, not the initial ones
    tok = AutoTokenizer.from_pretrained(path)
    text = "how many apples"
    assert tok.encode(text) == load_tokenizer("tiny:qwen3").encode(text)


def test_export_can_be_turned_off(tmp_path):
    engine = TrainingEngine(train_config(0, export_hf=False))
    engine.save(str(tmp_path))
    assert not (tmp_path / HF_EXPORT).exists()


@pytest.mark.parametrize("stage, dtype", [(0, "bfloat16"), (2, "float32"), (3, "bfloat16")])
def test_export_of_a_tied_model_holds_the_trained_weights_exactly(stage, dtype, tmp_path):
    """The export is the trainer's weights bit for bit, in its dtype, under the model's names,
    with tied embeddings stored once and tied again on load."""
    import dataclasses

    from polynya.models import load_model, tiny_tokenizer

    from .common import full_weights

    src = str(tmp_path / "tied")
    load_model("tiny:qwen3", tie_word_embeddings=True).save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    engine = TrainingEngine(dataclasses.replace(train_config(stage, dtype=dtype, lr=5e-2), model=src))
    batch = make_batch(5)
    for _ in range(2):
        engine.forward_backward(batch)
        engine.step()
    path = engine.save_pretrained(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == getattr(torch, dtype) and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    trained, exported = full_weights(engine.module), dict(model.named_parameters())
    assert list(trained) == list(exported)
    for name, want in trained.items():
        assert torch.equal(exported[name].detach(), want), name
    if dtype == "float32":
        with torch.no_grad():
            got = polynya.compute_logprobs(model, batch, zorro=False)
        torch.testing.assert_close(got.logprobs, engine.compute_logprobs(batch).logprobs.cpu(),
                                   rtol=1e-5, atol=1e-5)

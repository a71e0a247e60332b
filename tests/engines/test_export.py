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

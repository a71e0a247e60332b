"""A checkpoint loads only into an engine that would continue it as it was trained.

DeepSpeed restores the checkpoint's AdamW settings (``param_groups``), its LR schedule's base
rates and position, and (ZeRO-1/2) its clipping over the loading engine's config: an engine
built with another lr, betas, eps, weight decay, schedule or clip used to load and then train
with the checkpoint's values while reporting its own config. A checkpoint of another model
used to be copied in part before DeepSpeed failed (the engine half loaded). Both are refused
first, the engine unchanged; a tied-embedding model's checkpoint still resumes exactly. So is a
model of the same parameter shapes and another configuration (RoPE base, norm epsilon), which
used to load silently.
"""
from __future__ import annotations

import dataclasses

import pytest
from polynya.config.train import OptimConfig
from polynya.engines.train import TrainingEngine
from polynya.files import CheckpointError

from .common import make_batch, train_config

OPTIM = dict(eps=1e-3, grad_clip=1.0, schedule="warmup_cosine", warmup_steps=1, total_steps=10)
CHANGES = {  # setting changed on resume -> what the error names
    "lr": (dict(lr=1e-3), r"lr: \[0.005\] there, \[0.001\] here"),
    "betas": (dict(optim=dict(betas=(0.8, 0.99))), r"betas: \[\(0.9, 0.999\)\] there, \[\(0.8, 0.99\)\] here"),
    "eps": (dict(optim=dict(eps=1e-6)), r"eps: \[0.001\] there"),
    "weight_decay": (dict(optim=dict(weight_decay=0.1)), r"weight_decay: \[0.0\] there, \[0.1\] here"),
    "schedule": (dict(optim=dict(total_steps=20)), r"lr of step 2 \(the schedule\)"),
    "grad_clip": (dict(optim=dict(grad_clip=0.5)), r"gradient_clipping: 1.0 there, 0.5 here"),
}


def config(stage: int, dtype: str = "float32", lr: float = 5e-3, optim: dict | None = None, **kw):
    return train_config(stage, dtype=dtype, lr=lr, optim=OptimConfig(**{**OPTIM, **(optim or {})}),
                        export_hf=False, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two steps of each kind of engine, saved: ``{(stage, dtype): path}``."""
    out = {}
    for stage, dtype in ((0, "float32"), (0, "bfloat16"), (2, "float32"), (3, "float32")):
        engine = TrainingEngine(config(stage, dtype))
        for seed in (1, 2):
            engine.forward_backward(make_batch(seed))
            engine.step()
        path = str(tmp_path_factory.mktemp(f"z{stage}_{dtype}"))
        engine.save(path)
        out[stage, dtype] = path
    return out


def _refused_untouched(engine: TrainingEngine, path: str, match: str) -> None:
    before = engine.weight_checksum()
    with pytest.raises(CheckpointError, match=match):
        engine.load(path)
    assert engine.weight_checksum() == before
    assert engine.forward_backward(make_batch(3))["loss"] == engine.forward_backward(make_batch(3))["loss"]
    assert engine.step()["lr"] == engine.config.lr * engine.config.optim.lr_factor(0)  # its own schedule


@pytest.mark.parametrize("stage, dtype", [(0, "float32"), (0, "bfloat16"), (2, "float32"), (3, "float32")])
@pytest.mark.parametrize("change", list(CHANGES))
def test_other_optimizer_settings_are_refused_untouched(saved, stage, dtype, change):
    if change == "grad_clip" and (stage, dtype) == (0, "float32"):
        pytest.skip("plain fp32 ZeRO-0 clips itself from the config: a changed clip is honoured")
    kw, match = CHANGES[change]
    engine = TrainingEngine(config(stage, dtype, **kw))
    _refused_untouched(engine, saved[stage, dtype], "saved with other optimizer settings.*" + match)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_another_models_checkpoint_is_refused_untouched(saved, stage):
    """tiny:llama has no q/k norms and a wider MLP than tiny:qwen3."""
    engine = TrainingEngine(dataclasses.replace(config(stage), model="tiny:llama"))
    _refused_untouched(engine, saved[stage, "float32"],
                       r"another model's parameters \(not in this model: model.layers.0.self_attn.k_norm.weight"
                       r".*other shapes: model.layers.0.mlp.down_proj.weight \(64, 128\) there, \(64, 160\) here")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    from polynya.models import load_model, tiny_tokenizer

    d = str(tmp_path_factory.mktemp("tied"))
    model = load_model("tiny:qwen3", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_tied_models_checkpoint_resumes_exactly(tied_dir, stage, tmp_path):
    cfg = dataclasses.replace(config(stage), model=tied_dir)
    a = TrainingEngine(cfg)
    a.forward_backward(make_batch(1))
    a.step()
    a.save(str(tmp_path))
    b = TrainingEngine(cfg)
    b.load(str(tmp_path))
    for seed in (2, 3):
        assert (b.forward_backward(make_batch(seed))["loss"], b.step()) == (
            a.forward_backward(make_batch(seed))["loss"], a.step())
    assert b.weight_checksum() == a.weight_checksum()


@pytest.fixture(scope="module")
def other_rope_dir(tmp_path_factory):
    """tiny:qwen3 with another RoPE base: every parameter has the same name and shape."""
    from polynya.models import load_model, tiny_tokenizer

    d = str(tmp_path_factory.mktemp("rope"))
    model = load_model("tiny:qwen3")
    model.config.rope_parameters["rope_theta"] = 40000.0
    model.config.rms_norm_eps = 1e-3
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_another_configurations_checkpoint_is_refused_untouched(saved, other_rope_dir, stage):
    """Same parameter shapes, another RoPE base and norm epsilon: it used to load and compute
    other log-probs from the checkpoint's weights."""
    engine = TrainingEngine(dataclasses.replace(config(stage), model=other_rope_dir))
    _refused_untouched(engine, saved[stage, "float32"],
                       r"saved from a model of another configuration \(.*rms_norm_eps: 1e-06 there, "
                       r"0.001 here.*rope_theta")


def test_the_same_configuration_from_a_saved_copy_resumes(saved, tmp_path):
    """The loading-only fields (dtype, transformers version, name) are not the configuration: the
    checkpoint of ``tiny:qwen3`` resumes in an engine of a saved copy of it."""
    from polynya.models import load_model, tiny_tokenizer

    model = load_model("tiny:qwen3")
    model.save_pretrained(str(tmp_path))
    tiny_tokenizer().save_pretrained(str(tmp_path))
    copy, same = (TrainingEngine(dataclasses.replace(config(2), model=m))
                  for m in (str(tmp_path), "tiny:qwen3"))
    for engine in (copy, same):
        engine.load(saved[2, "float32"])
    assert copy.weight_checksum() == same.weight_checksum()
    assert copy.forward_backward(make_batch(3))["loss"] == same.forward_backward(make_batch(3))["loss"]

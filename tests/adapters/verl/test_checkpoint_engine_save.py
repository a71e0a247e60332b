"""verl's checkpoint options on the ``deepspeed`` backend: ``max_ckpt_to_keep``, ``save_contents``
/ ``load_contents`` (``hf_model`` included), ``hdfs_path`` and ``del_local_after_load``.

Checkpoints go where verl's trainer puts them (``<dir>/global_step_N/actor``), with a training
step between saves so every checkpoint holds other weights. Oracles: the folders on disk after
each save, the weight checksum of the saving engine against that of a fresh engine that loaded
the checkpoint, and plain transformers loading the ``huggingface`` export. Refused arguments
leave every byte on disk as it was.
"""
from __future__ import annotations

import hashlib
import os
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from polynya.adapters.verl.batch import read_batch
from polynya.adapters.verl.engine import DeepSpeedLMEngine
from polynya.adapters.verl.settings import DeepSpeedEngineConfig
from polynya.files import verify_manifest
from transformers import AutoModelForCausalLM
from verl.trainer.config import CheckpointConfig
from verl.workers.config import FSDPOptimizerConfig
from verl.workers.utils.losses import ppo_loss

from .test_engine import SEED, actor_config, make, weights

EVERYTHING = ["model", "optimizer", "extra"]


def build(save_contents=EVERYTHING, load_contents=EVERYTHING, **engine) -> DeepSpeedLMEngine:
    """A verl-built engine on the tiny model (fp32, CPU; ZeRO-0 unless ``engine`` says otherwise)."""
    cfg = DeepSpeedEngineConfig(**{"dtype": "float32", "zero_stage": 0, "seed": SEED, "use_dynamic_bsz": True,
                                   "max_token_len_per_gpu": 4096, **engine})
    model = SimpleNamespace(path="tiny:qwen3", local_path=None, lora_rank=0, enable_gradient_checkpointing=False)
    checkpoint = CheckpointConfig(save_contents=list(save_contents), load_contents=list(load_contents))
    return DeepSpeedLMEngine(model, cfg, FSDPOptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
                             checkpoint_config=checkpoint)


def train_step(engine: DeepSpeedLMEngine, seed: int, step: bool = True) -> None:
    engine.optimizer_zero_grad()
    engine.forward_backward_batch(make(seed)[0], partial(ppo_loss, config=actor_config()))
    if step:
        engine.optimizer_step()


def actor(root, step: int) -> str:
    return os.path.join(str(root), f"global_step_{step}", "actor")


def disk(root) -> dict[str, str]:
    """Every file and folder under ``root``: relative path -> sha256 of its bytes ('' for a folder)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = ""
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def loaded_checksum(path: str, **engine) -> str:
    """The weight checksum of a fresh engine after ``load_checkpoint(path)``."""
    fresh = build(**engine)
    fresh.initialize()
    fresh.load_checkpoint(path)  # del_local_after_load=True, verl's default: the files stay (local)
    return fresh.trainer.weight_checksum()


@pytest.fixture(scope="module")
def trained():
    engine = build()
    engine.initialize()
    return engine


def test_max_ckpt_to_keep_keeps_the_newest_this_engine_saved(trained, tmp_path):
    other = build()  # another engine's checkpoint in the same tree is never touched
    other.initialize()
    other.save_checkpoint(actor(tmp_path, 0), global_step=0, max_ckpt_to_keep=1)
    os.makedirs(os.path.join(tmp_path, "global_step_1"))
    with open(os.path.join(tmp_path, "global_step_1", "data.pt"), "wb") as f:  # verl's dataloader state
        f.write(b"dataloader")
    sums = {}
    for step in range(1, 5):
        train_step(trained, step)
        trained.save_checkpoint(actor(tmp_path, step), global_step=step, max_ckpt_to_keep=2)
        sums[step] = trained.trainer.weight_checksum()
        kept = {s for s in range(5) if os.path.isdir(actor(tmp_path, s))}
        assert kept == {0} | {s for s in (step - 1, step) if s >= 1}, step
    assert len(set(sums.values())) == 4  # every save held other weights
    assert os.listdir(os.path.join(tmp_path, "global_step_1")) == ["data.pt"]  # only the actor folder went
    for step in (3, 4):
        verify_manifest(actor(tmp_path, step))
        assert loaded_checksum(actor(tmp_path, step)) == sums[step]
    assert os.path.isdir(actor(tmp_path, 4))  # del_local_after_load left the local checkpoint alone

    # a failed save removes nothing: gradients pending, save refuses, the older checkpoints stay
    train_step(trained, 5, step=False)
    before = disk(tmp_path)
    with pytest.raises(RuntimeError, match="pending"):
        trained.save_checkpoint(actor(tmp_path, 5), global_step=5, max_ckpt_to_keep=1)
    assert disk(tmp_path) == before
    trained.optimizer_step()
    trained.save_checkpoint(actor(tmp_path, 5), global_step=5, max_ckpt_to_keep=1)
    assert {s for s in range(6) if os.path.isdir(actor(tmp_path, s))} == {0, 5}

    # a path saved again counts once, as its newest save (verl would count it twice and remove it)
    for step in (6, 5):
        train_step(trained, step)
        trained.save_checkpoint(actor(tmp_path, step), global_step=step, max_ckpt_to_keep=2)
    assert {s for s in range(7) if os.path.isdir(actor(tmp_path, s))} == {0, 5, 6}
    assert loaded_checksum(actor(tmp_path, 5)) == trained.trainer.weight_checksum()

    # None and 0 keep every checkpoint, as verl does
    for step, keep in ((7, None), (8, 0)):
        trained.save_checkpoint(actor(tmp_path, step), global_step=step, max_ckpt_to_keep=keep)
    assert {s for s in range(9) if os.path.isdir(actor(tmp_path, s))} == {0, 5, 6, 7, 8}


@pytest.mark.parametrize("kwargs, message", [
    ({"max_ckpt_to_keep": -1}, "max_ckpt_to_keep"),
    ({"max_ckpt_to_keep": True}, "max_ckpt_to_keep"),
    ({"max_ckpt_to_keep": 1.0}, "max_ckpt_to_keep"),
    ({"max_ckpt_to_keep": "2"}, "max_ckpt_to_keep"),
    ({"hdfs_path": "hdfs://somewhere/actor"}, "hdfs_path"),
])
def test_bad_save_arguments_leave_the_disk_unchanged(trained, tmp_path, kwargs, message):
    trained.save_checkpoint(actor(tmp_path, 1), global_step=1)
    trained.save_checkpoint(actor(tmp_path, 2), global_step=2)
    before = disk(tmp_path)
    with pytest.raises(ValueError, match=message):
        trained.save_checkpoint(actor(tmp_path, 3), global_step=3, **kwargs)
    assert disk(tmp_path) == before
    with pytest.raises(ValueError, match=message):  # a save into a folder holding a checkpoint
        trained.save_checkpoint(actor(tmp_path, 2), global_step=2, **kwargs)
    assert disk(tmp_path) == before


def test_load_refuses_hdfs_path_and_leaves_the_engine_unchanged(trained, tmp_path):
    trained.save_checkpoint(actor(tmp_path, 1), global_step=1)
    fresh = build()
    fresh.initialize()
    before = fresh.trainer.weight_checksum()
    with pytest.raises(ValueError, match="hdfs_path"):
        fresh.load_checkpoint(actor(tmp_path, 1), hdfs_path="hdfs://somewhere/actor")
    assert fresh.trainer.weight_checksum() == before != trained.trainer.weight_checksum()


def test_hf_model_writes_verls_huggingface_export_and_the_checkpoint_still_loads(tmp_path):
    engine = build(save_contents=EVERYTHING + ["hf_model"])
    engine.initialize()
    train_step(engine, 1)
    path = actor(tmp_path, 1)
    engine.save_checkpoint(path, global_step=1)
    assert os.path.isdir(os.path.join(path, "huggingface")) and not os.path.exists(os.path.join(path, "hf"))
    verify_manifest(path)  # the export is in the manifest

    model = AutoModelForCausalLM.from_pretrained(os.path.join(path, "huggingface"), dtype=torch.float32)
    mine, theirs = weights(engine.trainer.module), weights(model)
    assert mine.keys() == theirs.keys()
    for name, w in mine.items():
        assert torch.equal(theirs[name], w), name
    assert loaded_checksum(path) == engine.trainer.weight_checksum()

    # saved again into the same folder: the old export is replaced, the manifest still verifies
    train_step(engine, 2)
    engine.save_checkpoint(path, global_step=2)
    verify_manifest(path)
    assert loaded_checksum(path) == engine.trainer.weight_checksum()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(path, "huggingface"), dtype=torch.float32)
    for name, w in weights(engine.trainer.module).items():
        assert torch.equal(weights(model)[name], w), name


def test_without_hf_model_no_export_is_written(trained, tmp_path):
    trained.save_checkpoint(actor(tmp_path, 1), global_step=1)
    assert not {"huggingface", "hf"} & set(os.listdir(actor(tmp_path, 1)))


@pytest.mark.parametrize("contents, message", [
    ({"save_contents": ["model"]}, r"save_contents=\['model'\] leaves out \['optimizer', 'extra'\]"),
    ({"save_contents": ["model", "extra", "hf_model"]}, r"save_contents=.* leaves out \['optimizer'\]"),
    ({"save_contents": ["hf_model"]}, r"save_contents=.* leaves out"),
    ({"save_contents": EVERYTHING + ["hf"]}, r"save_contents=.*\['hf'\] unknown"),
    ({"load_contents": ["model", "optimizer"]}, r"load_contents=.* leaves out \['extra'\]"),
    ({"load_contents": EVERYTHING + ["weights"]}, r"load_contents=.*\['weights'\] unknown"),
])
def test_contents_polynya_cannot_split_are_refused_when_the_engine_is_built(contents, message):
    with pytest.raises(ValueError, match=message):
        build(**contents)


def test_hf_model_in_load_contents_passes():
    """verl's FSDP engine ignores it on load; the checkpoint's own weights are the exported ones."""
    build(save_contents=EVERYTHING + ["hf_model"], load_contents=EVERYTHING + ["hf_model"])


def test_offloaded_engine_saves_and_loads_outside_verls_mode_contexts(tmp_path):
    """With param_offload verl calls save/load on an offloaded engine (outside train_mode); the
    states come back for it and go out again after, as verl's FSDP engine does."""
    offload = {"zero_stage": 2, "param_offload": True, "optimizer_offload": True}
    engine = build(**offload)
    engine.initialize()
    with engine.train_mode():
        train_step(engine, 1)
        want = engine.trainer.weight_checksum()
    engine.save_checkpoint(actor(tmp_path, 1), global_step=1)
    rows = read_batch(make()[0]).batch
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.trainer.compute_logprobs(rows)  # offloaded again after the save
    fresh = build(**offload)
    fresh.initialize()
    fresh.load_checkpoint(actor(tmp_path, 1))
    with pytest.raises(RuntimeError, match="offloaded"):
        fresh.trainer.compute_logprobs(rows)
    with fresh.eval_mode():
        assert fresh.trainer.weight_checksum() == want

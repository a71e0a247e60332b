"""Fault injection: bad weights, poisoned gradients and damaged checkpoints never change state.

Each case compares the state before and after (weights checksum, optimizer tensors and step,
LR, weight version, files) and asserts the outcome (a clear error naming the problem, or a
skipped step counted in the metrics), not just "no exception".
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from polynya import RolloutBatch
from polynya.checksum import checksum_named_tensors
from polynya.config.logprob import LogProbConfig
from polynya.config.sampler import SamplerConfig
from polynya.engines.logprob import LogProbEngine
from polynya.engines.sample import SamplingEngine
from polynya.engines.train import TrainingEngine
from polynya.files import CheckpointError, verify_manifest, write_manifest

from .common import CUDA, MODEL, assert_same_tensors, full_weights, make_batch, optimizer_state, train_config

# ---------------------------------------------------------------- load_weights is all or nothing


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    from polynya.models import load_model

    return {n: p.detach().clone() for n, p in load_model(MODEL, dtype="float32", seed=seed).named_parameters()}


def bad_loads(good: dict[str, torch.Tensor]):
    """(case, pieces, checksum, version, error pattern): each must be refused untouched."""
    names = list(good)
    first, t0 = names[0], good[names[0]]
    nan = {n: t.clone() for n, t in good.items()}
    nan[names[-1]].view(-1)[3] = float("nan")
    short = torch.cat([good[n].reshape(-1) for n in names])[:-1]
    right = checksum_named_tensors(good.items())
    swapped = {n: t.clone() for n, t in good.items()}
    flat = swapped[names[1]].view(-1)
    flat[0], flat[8191 % flat.numel()] = flat[8191 % flat.numel()].clone(), flat[0].clone()
    return [
        ("good piece then an unknown name", [(first, t0), ("bogus.weight", t0)], None, None, "unknown"),
        ("wrong shape", [(first, t0), (names[1], good[names[1]].reshape(-1)[:5])], None, None, "shape"),
        ("a name twice", [(first, t0), (first, t0)], None, None, "twice"),
        ("integer tensor", [(first, t0.to(torch.int32))], None, None, "floating point"),
        ("NaN in the last tensor", nan, None, None, "NaN or inf"),
        ("bucket one element short", [(names, short)], None, None, "flat bucket"),
        ("checksum of other weights", good, "0" * 32, None, "checksum mismatch"),
        ("two values swapped after the checksum", swapped, right, None, "checksum mismatch"),
        ("stale version", good, right, 0, "not newer"),
        ("no weights at all", {}, None, None, "no weights"),
    ]


def check_atomic(engine, good) -> None:
    before, version = engine.weight_checksum(), engine.weight_version
    for case, pieces, checksum, ver, match in bad_loads(good):
        with pytest.raises(ValueError, match=match):
            engine.load_weights(pieces, version=ver, checksum=checksum)
        assert engine.weight_checksum() == before and engine.weight_version == version, case
    right = checksum_named_tensors(good.items())
    assert engine.load_weights(good, version=version + 2, checksum=right) == version + 2
    assert engine.weight_checksum() == right != before


@pytest.mark.parametrize("stage", [0, 3])
def test_logprob_engine_load_weights_is_atomic(stage):
    engine = LogProbEngine(LogProbConfig(MODEL, dtype="float32", zero_stage=stage))
    check_atomic(engine, new_weights(seed=5))


def test_sampler_load_weights_is_atomic():
    engine = SamplingEngine(SamplerConfig(MODEL, dtype="float32", num_blocks=64, seed=0))
    check_atomic(engine, new_weights(seed=6))


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    from polynya.models import load_model, tiny_tokenizer

    d = str(tmp_path_factory.mktemp("tied") / "tiny_qwen3_tied")
    model = load_model(MODEL, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.mark.parametrize("engine_kind", ["sampler", "logprob_z0", "logprob_z3"])
def test_two_values_for_one_tied_parameter_are_refused(tied_dir, engine_kind):
    """An untied trainer's embedding and LM head, loaded into a tied model, used to leave the
    embedding equal to whichever came last; equal values (a state dict lists a tied parameter
    under both names) load."""
    if engine_kind == "sampler":
        engine = SamplingEngine(SamplerConfig(tied_dir, dtype="float32", num_blocks=64, seed=0))
    else:
        engine = LogProbEngine(LogProbConfig(tied_dir, dtype="float32", zero_stage=int(engine_kind[-1])))
    before, version = engine.weight_checksum(), engine.weight_version
    shape = (512, 64)  # the tiny vocabulary x hidden size
    a, b = (torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight' are one tied"):
        engine.load_weights([("model.embed_tokens.weight", a), ("lm_head.weight", b)])
    assert engine.weight_checksum() == before and engine.weight_version == version
    engine.load_weights([("model.embed_tokens.weight", a), ("lm_head.weight", a.clone())])
    assert engine.weight_checksum() != before and engine.weight_version == version + 1


# ---------------------------------------------------------------- non-finite gradients skip the step


def poisoned(batch: RolloutBatch) -> RolloutBatch:
    """Finite but huge advantages: the loss and gradients overflow to inf / NaN."""
    adv = torch.where(torch.arange(len(batch)) % 2 == 0, 3e38, -3e38)
    return RolloutBatch(batch.prompts, batch.responses, advantages=adv, old_logprobs=batch.old_logprobs)


@pytest.mark.parametrize("fused", [False, True], ids=["multi-tensor-adamw", "fused-adamw"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_non_finite_grad_norm_skips_the_step(stage, fused):
    """Both AdamW kernels (the fused one is the default on CUDA)."""
    engine = TrainingEngine(train_config(stage, optim={"eps": 1e-3, "grad_clip": 1.0,
                                                        "schedule": "warmup_cosine", "warmup_steps": 1,
                                                        "total_steps": 10, "fused": fused}))
    assert all(bool(g["fused"]) == fused for g in engine._sched.optimizer.param_groups)
    engine.forward_backward(make_batch(40))
    first = engine.step()
    assert first["skipped"] == 0.0 and first["skipped_steps"] == 0
    weights, opt, sums = full_weights(engine.module), optimizer_state(engine), engine.weight_checksum()
    lr = engine.engine.optimizer.param_groups[0]["lr"]
    engine.forward_backward(poisoned(make_batch(41)))
    out = engine.step()
    assert out["skipped"] == 1.0 and out["skipped_steps"] == 1
    assert not torch.isfinite(torch.tensor(out["grad_norm"]))
    assert engine.weight_checksum() == sums
    assert_same_tensors(full_weights(engine.module), weights)
    assert_same_tensors(optimizer_state(engine), opt)  # Adam moments, step count, fp32 master
    assert engine.engine.optimizer.param_groups[0]["lr"] == lr  # the schedule did not advance
    engine.forward_backward(make_batch(42))  # the next good batch trains normally
    nxt = engine.step()
    assert nxt["skipped"] == 0.0 and nxt["skipped_steps"] == 1 and nxt["lr"] == lr
    assert engine.weight_checksum() != sums
    assert all(torch.isfinite(t).all() for t in full_weights(engine.module).values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_norm_past_fp32_skips_on_every_stage(stage, clip, device):
    """One finite gradient element of 1e30: the norm's square is not an fp32, so ZeRO-0/1/2
    skip; ZeRO-3 (whose norm is taken in fp64) skips too, instead of applying the step and, unclipped,
    leaving inf in Adam's second moment for good."""
    engine = TrainingEngine(train_config(stage, optim={"grad_clip": clip}, device=device))
    engine.forward_backward(make_batch(40))
    assert engine.step()["skipped"] == 0.0
    weights, opt, lr = full_weights(engine.module), optimizer_state(engine), engine._sched.get_last_lr()
    name = "model.layers.0.mlp.up_proj.weight"

    def huge(grad):
        grad = grad.clone()
        grad.view(-1)[37] = 1e30
        return grad

    hook = dict(engine.module.named_parameters())[name].register_hook(huge)
    engine.forward_backward(make_batch(41))
    hook.remove()
    out = engine.step()
    assert out["skipped"] == 1.0 and out["skipped_steps"] == 1, out
    assert_same_tensors(full_weights(engine.module), weights)
    assert_same_tensors(optimizer_state(engine), opt)
    assert engine._sched.get_last_lr() == lr
    engine.forward_backward(make_batch(42))
    assert engine.step()["skipped"] == 0.0
    assert all(torch.isfinite(t).all() for t in optimizer_state(engine))


@pytest.mark.parametrize("stage", [0, 2])
def test_skipped_steps_survive_a_checkpoint(stage, tmp_path):
    """ZeRO-0 in fp32 counts its own skips (DeepSpeed counts the others'): both kinds are in
    the checkpoint, and a resumed engine reports the same count as an uninterrupted one."""
    engine = TrainingEngine(train_config(stage))
    for batch in (make_batch(40), poisoned(make_batch(41))):
        engine.forward_backward(batch)
        engine.step()
    assert engine.skipped_steps == 1
    engine.save(str(tmp_path / "ckpt"))
    resumed = TrainingEngine(train_config(stage))
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.skipped_steps == 1
    for e in (engine, resumed):
        e.forward_backward(make_batch(42))
    a, b = engine.step(), resumed.step()
    assert a["skipped_steps"] == b["skipped_steps"] == 1 and a["step"] == b["step"]
    assert a["grad_norm"] == b["grad_norm"]


# ---------------------------------------------------------------- damaged checkpoints are refused

MARKER = "polynya_pwned_marker"


class Payload:
    """A pickle that runs code when loaded (what a planted checkpoint file could hold)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _flip_middle(path: str) -> None:
    with open(path, "r+b") as f:
        size = os.path.getsize(path)
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x55]))


def _damages(tmp: str):
    """(case, damage function on a copy of the checkpoint, pattern the error must name)."""
    model = os.path.join("polynya", "mp_rank_00_model_states.pt")
    optim = os.path.join("polynya", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    marker = os.path.join(tmp, MARKER)

    def flip(d):
        _flip_middle(os.path.join(d, model))

    def truncate(d):
        p = os.path.join(d, optim)
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) - 100)

    def no_manifest(d):
        os.remove(os.path.join(d, "MANIFEST.json"))

    def extra(d):
        shutil.copy(os.path.join(d, optim), os.path.join(d, "polynya", "other_rank_states.pt"))

    def planted(d):  # a code-running pickle, manifest rewritten to match: must still not run
        torch.save({"optimizer_state_dict": Payload(marker)}, os.path.join(d, optim))
        write_manifest(d)

    def missing(d):
        os.remove(os.path.join(d, model))

    def linked(d):  # the tag directory a link to files no manifest lists (walks do not enter links)
        elsewhere = d + "_files"
        shutil.move(os.path.join(d, "polynya"), elsewhere)
        os.symlink(elsewhere, os.path.join(d, "polynya"))
        with open(os.path.join(d, "MANIFEST.json"), "w") as f:
            f.write('{"format": 1, "files": {}}')

    return [("bytes flipped in a tensor record", flip, "mp_rank_00_model_states.pt.*corrupted"),
            ("truncated optimizer file", truncate, "optim_states.pt.*bytes"),
            ("no manifest", no_manifest, "MANIFEST"),
            ("a file of another checkpoint", extra, "other_rank_states.pt.*not in"),
            ("missing file", missing, "model_states.pt.*missing"),
            ("planted pickle", planted, "optim_states.pt.*weights only"),
            ("the tag directory a symbolic link", linked, "polynya.*symbolic link to a directory")], marker


def test_damaged_checkpoints_are_refused_untouched(tmp_path):
    engine = TrainingEngine(train_config(2, optim={"eps": 1e-3, "grad_clip": 1.0}))
    engine.forward_backward(make_batch(50))
    engine.step()
    saved = str(tmp_path / "good")
    engine.save(saved)
    assert os.path.isfile(os.path.join(saved, "MANIFEST.json"))
    engine.forward_backward(make_batch(51))
    engine.step()  # the engine moves on: a load must bring the saved state back
    weights, opt, sums = full_weights(engine.module), optimizer_state(engine), engine.weight_checksum()
    steps = int(engine.engine.global_steps)
    cases, marker = _damages(str(tmp_path))
    for case, damage, match in cases:
        copy = str(tmp_path / case.replace(" ", "_"))
        shutil.copytree(saved, copy)
        damage(copy)
        with pytest.raises(CheckpointError, match=match):
            engine.load(copy)
        assert not os.path.exists(marker), f"{case}: the planted pickle ran"
        assert engine.weight_checksum() == sums and int(engine.engine.global_steps) == steps, case
        assert_same_tensors(full_weights(engine.module), weights)
        assert_same_tensors(optimizer_state(engine), opt)
    engine.load(saved)  # the intact checkpoint still loads
    assert engine.weight_checksum() != sums and int(engine.engine.global_steps) == 1


@pytest.mark.parametrize("saved, loading", [((0, "bfloat16"), (0, "float32")), ((2, "float32"), (2, "bfloat16")),
                                            ((2, "float32"), (1, "float32")), ((3, "float32"), (2, "float32")),
                                            ((3, "float32"), (3, "bfloat16"))])
def test_a_checkpoint_of_another_kind_of_engine_is_refused_untouched(tmp_path, saved, loading):
    """A checkpoint saved at another dtype or ZeRO stage used to load the weights and then
    fail on DeepSpeed's optimizer files (the engine half loaded); it is refused first. ZeRO-3
    names its model states per rank: its checkpoints went unchecked (a bare AssertionError,
    or a missing bf16 optimizer file, with the engine half loaded)."""
    TrainingEngine(train_config(saved[0], dtype=saved[1])).save(str(tmp_path))
    engine = TrainingEngine(train_config(loading[0], dtype=loading[1]))
    before = engine.weight_checksum()
    with pytest.raises(CheckpointError, match=f"saved by a ZeRO-{saved[0]} {saved[1]} engine on 1 rank"):
        engine.load(str(tmp_path))
    assert engine.weight_checksum() == before
    engine.forward_backward(make_batch(3))  # not half loaded: it trains on
    engine.step()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_save_interrupted_over_an_older_checkpoint_is_refused(tmp_path, stage):
    """A second save into the same directory that dies between files (here: in the Hugging Face
    export, after DeepSpeed rewrote its files) must not load as either save: the older manifest
    is removed before anything is written, so the load refuses it, the engine unchanged."""
    path = str(tmp_path / "ckpt")
    engine = TrainingEngine(train_config(stage))
    engine.save(path)
    engine.forward_backward(make_batch(60))
    engine.step()

    def dies(_path):
        raise OSError("injected: disk full")
    engine.save_pretrained = dies
    with pytest.raises(OSError, match="injected"):
        engine.save(path)
    fresh = TrainingEngine(train_config(stage))
    before = fresh.weight_checksum()
    with pytest.raises(CheckpointError, match="no MANIFEST.json: not a complete polynya checkpoint"):
        fresh.load(path)
    assert fresh.weight_checksum() == before


def test_a_save_over_an_older_checkpoint_leaves_none_of_its_files(tmp_path):
    """The older checkpoint's Hugging Face export (the new save writes none) stayed in the
    directory and entered the new manifest: ``hf/`` then held the older weights, silently. A
    file the old manifest did not list is not ours and stays."""
    path = str(tmp_path / "ckpt")
    engine = TrainingEngine(train_config(2, export_hf=True))
    engine.save(path)
    assert os.path.isdir(os.path.join(path, "hf"))
    with open(os.path.join(path, "NOTES.txt"), "w") as f:
        f.write("the user's")
    engine.forward_backward(make_batch(61))
    engine.step()
    engine.config = dataclasses.replace(engine.config, export_hf=False)
    engine.save(path)
    assert not os.path.exists(os.path.join(path, "hf"))
    assert open(os.path.join(path, "NOTES.txt")).read() == "the user's"
    fresh = TrainingEngine(train_config(2))
    fresh.load(path)
    assert fresh.weight_checksum() == engine.weight_checksum()


def test_the_hugging_face_export_goes_where_save_is_told_and_is_verified(tmp_path):
    """``save(hf_export=...)`` (verl's ``huggingface`` folder) writes the export there whatever
    ``export_hf`` says, lists it in the manifest (a later load verifies it: a changed export
    file is refused), and a name outside the checkpoint is refused before anything is written."""
    path = str(tmp_path / "ckpt")
    engine = TrainingEngine(train_config(2, export_hf=False))
    for bad in ("/abs", "../out", "", 3, ".", "a/../..", "polynya", "polynya/hf"):
        with pytest.raises(ValueError, match="hf_export must name a sub-directory"):
            engine.save(path, hf_export=bad)
        assert not os.path.exists(path)
    engine.save(path, hf_export="huggingface")
    assert not os.path.exists(os.path.join(path, "hf"))
    listed = verify_manifest(path)["files"]
    assert any(name.startswith("huggingface/") and name.endswith(".safetensors") for name in listed)
    fresh = TrainingEngine(train_config(2))
    fresh.load(path)
    assert fresh.weight_checksum() == engine.weight_checksum()
    with open(os.path.join(path, "huggingface", "config.json"), "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match="config.json"):
        fresh.load(path)


def test_a_save_with_gradients_pending_is_refused(tmp_path):
    """The checkpoint would hold the state before the pending micro-batches; a resume would
    lose them. Refused, the checkpoint already in the directory untouched."""
    path = str(tmp_path / "ckpt")
    engine = TrainingEngine(train_config(2))
    engine.save(path)
    saved = {n: os.path.getmtime(os.path.join(r, n)) for r, _, fs in os.walk(path) for n in fs}
    engine.forward_backward(make_batch(62))
    with pytest.raises(RuntimeError, match=r"save\(\) with the gradients of 1 forward_backward"):
        engine.save(path)
    assert {n: os.path.getmtime(os.path.join(r, n)) for r, _, fs in os.walk(path) for n in fs} == saved
    engine.step()
    engine.save(path)  # nothing pending: saves

"""Every recipe override of the ``client`` section takes effect on the built config (or is
rejected): one place per setting, no silent overwrite between the client and its engines."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import polynya
from polynya.recipes.schema import check_overrides, register, to_client_config

register()


def _compose(overrides):
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        return compose("config", overrides=overrides)


def _leaves(node, prefix):
    for k in node:
        v = node[k]
        if OmegaConf.is_dict(v) and k != "deepspeed":
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# key -> (override value, extra overrides, {path on RLClientConfig: expected value})
SAME = object()  # expected: the override value itself at the key's own path
VALUES = {
    "model_name": ("tiny:llama", [], {"train.model": "tiny:llama", "logprob.model": "tiny:llama",
                                      "sampling.model": "tiny:llama"}),
    "dtype": ("bfloat16", [], {"train.dtype": "bfloat16", "logprob.dtype": "bfloat16",
                               "sampling.dtype": "bfloat16"}),
    "comm_protocol": ("http", [], {}),
    "training_gpus": (2, ["client.sampling_gpus=2"], {}),
    "sampling_gpus": (2, ["client.colocate=false"], {}),
    "log_prob_gpus": (1, [], {}),
    "colocate": (False, [], {}),
    "offload_trainer": (False, [], {}),
    "sampler": ("vllm", [], {"sampling.backend": "vllm"}),
    "zorro_train": (False, [], {"train.zorro": False, "logprob.zorro": False}),
    "fca": (False, [], {"sampling.fca": False}),
    "reference_model": (True, [], {}),
    "device": ("cpu", [], {"train.device": "cpu", "logprob.device": "cpu", "sampling.device": "cpu"}),
    "cpu_threads": (3, [], {}),
    "bucket_bytes": (4096, [], {}),
    "timeout_s": (5.5, [], {}),
    "sync_peer_timeout_s": (7.5, [], {}),
    "server_url": ("http://127.0.0.1:9", [], {}),
    "api_token": ("secret", [], {}),
    "max_body_bytes": (1000, [], {}),
    "run_dir": ("/tmp/polynya-run", [], {}),
    "ray_address": ("auto", [], {}),
    "device_resource": ("CPU", [], {}),
    "train.zero_stage": (3, [], {}),
    "train.lr": (0.5, [], {}),
    "train.zorro_attention": ("flex", [], {}),
    "train.naive_layout": ("padded", [], {}),
    "train.loss": ("dapo", [], {}),
    "train.seed": (7, [], {"logprob.seed": 7, "sampling.seed": 7}),
    "train.optim.betas": ([0.8, 0.9], [], {"train.optim.betas": [0.8, 0.9]}),
    "train.optim.eps": (1e-6, [], {}),
    "train.optim.weight_decay": (0.1, [], {}),
    "train.optim.schedule": ("warmup_cosine", ["client.train.optim.total_steps=50"], {}),
    "train.optim.warmup_steps": (3, [], {}),
    "train.optim.total_steps": (100, [], {}),
    "train.optim.min_lr_ratio": (0.1, [], {}),
    "train.optim.grad_clip": (0.5, [], {}),
    "train.optim.fused": (True, [], {}),
    "train.loss_config.clip_low": (0.1, [], {}),
    "train.loss_config.clip_high": (0.3, [], {}),
    "train.loss_config.norm": ("token", [], {}),
    "train.loss_config.kl_norm": ("sequence", [], {}),
    "train.loss_config.max_response_len": (64, [], {}),
    "train.loss_config.kl_coef": (0.1, [], {}),
    "train.loss_config.kl_estimator": ("k1", [], {}),
    "train.loss_config.entropy_coef": (0.01, [], {}),
    "train.loss_config.log_ratio_clip": (20.0, [], {}),
    "train.loss_config.kl_clip": (10.0, [], {}),
    "train.micro_batch_tokens": (1000, [], {}),
    "train.max_tokens_per_row": (500, [], {}),
    "train.temperature": (0.7, [], {"logprob.temperature": 0.7}),
    "train.gradient_checkpointing": (True, [], {}),
    "train.fused_kernels": (True, [], {}),
    "train.compile_layers": (True, [], {}),
    "train.log_entropy": (False, [], {}),
    "train.deepspeed": ({"steps_per_print": 5}, [], {}),
    "train.export_hf": (False, [], {}),
    "logprob.zero_stage": (3, [], {}),
    "logprob.zorro_attention": ("split", [], {}),
    "logprob.naive_layout": ("packed", [], {}),
    "logprob.micro_batch_tokens": (999, [], {}),
    "logprob.max_tokens_per_row": (77, [], {}),
    "logprob.deepspeed": ({"steps_per_print": 3}, [], {}),
    "logprob.fused_kernels": (True, [], {}),
    "logprob.compile_layers": (True, [], {}),
    "sampling.block_size": (32, [], {}),
    "sampling.num_blocks": (64, [], {}),
    "sampling.kv_cache_memory_gb": (0.5, [], {}),
    "sampling.max_num_seqs": (17, [], {}),
    "sampling.max_num_batched_tokens": (4096, [], {}),
    "sampling.max_model_len": (256, [], {}),
    "sampling.fca_min_shared_tokens": (0, [], {}),
    "sampling.fca_chunk_tokens": (512, [], {}),
    "sampling.fca_shared_progs_per_sm": (3, [], {}),
    "sampling.cuda_graphs": (False, [], {}),
    "sampling.async_scheduling": (False, [], {}),
    "sampling.compile_decode": (True, [], {}),
    "sampling.compile_scope": ("model", [], {}),
    "sampling.fuse_projections": (True, [], {}),
    "sampling.compile_prefill": (True, [], {}),
}


def _override(key, value) -> str:
    if isinstance(value, dict):  # raw DeepSpeed keys are added with "+" (the dict starts empty)
        (k, v), = value.items()
        return f"+client.{key}.{k}={v}"
    if isinstance(value, list):
        return f"client.{key}=[{', '.join(map(str, value))}]"
    return f"client.{key}={str(value).lower() if isinstance(value, bool) else value}"


def test_every_client_key_has_a_checked_override():
    keys = {k[len("client."):] for k in _leaves(_compose([]).client, "client.")}
    assert keys == set(VALUES), f"add the new keys to VALUES: {keys ^ set(VALUES)}"


@pytest.mark.parametrize("key", sorted(VALUES))
def test_override_takes_effect(key):
    value, extra, expect = VALUES[key]
    default = to_client_config(_compose([]).client)
    built = to_client_config(_compose([_override(key, value), *extra]).client)
    want = list(value) if isinstance(value, list) else value
    assert _get(default, key) != want  # the override changes something
    got = _get(built, key)
    assert (list(got) if isinstance(got, tuple) else got) == want
    for path, v in expect.items():
        got = _get(built, path)
        assert (list(got) if isinstance(got, tuple) else got) == v, path


@pytest.mark.parametrize("key, owner", [("client.train.dtype", "client.dtype"),
                                        ("client.train.zorro", "client.zorro_train"),
                                        ("client.sampling.fca", "client.fca"),
                                        ("client.sampling.backend", "client.sampler"),
                                        ("client.logprob.seed", "client.train.seed"),
                                        ("client.logprob.temperature", "client.train.temperature"),
                                        ("client.train.model", "client.model_name")])
def test_client_owned_engine_fields_are_rejected_with_the_key_to_use(key, owner):
    with pytest.raises(ValueError, match=owner.replace(".", r"\.")):
        check_overrides([f"{key}=x"])
    with pytest.raises(ConfigCompositionException):
        _compose([f"{key}=1"])
    check_overrides([f"{owner}=1", "client.train.lr=0.1", "run.steps=3"])  # the right keys pass


@pytest.mark.parametrize("section, field, value, owner", [
    ("train", "zorro", False, "zorro_train"),
    ("train", "dtype", "float32", "dtype"),
    ("sampling", "fca", False, "fca"),
    ("sampling", "backend", "vllm", "sampler"),
    ("logprob", "seed", 4, "train.seed"),
    ("train", "model", "tiny:llama", "model_name"),
])
def test_python_contradiction_names_both_keys(section, field, value, owner):
    with pytest.raises(ValueError, match=rf"{section}\.{field}=.*contradicts RLClientConfig\.{owner}"):
        polynya.RLClientConfig("tiny:qwen3", **{section: {field: value}})


def test_engine_section_agreeing_with_client_and_former_fca_name():
    cfg = polynya.RLClientConfig("tiny:qwen3", dtype="float32", zorro_train=False,
                                 train=polynya.config.TrainConfig("tiny:qwen3", dtype="float32", zorro=False))
    assert cfg.train.zorro is False and cfg.logprob.zorro is False
    old = polynya.RLClientConfig("tiny:qwen3", zorro_inference=False)
    assert old.fca is False and old.sampling.fca is False
    with pytest.raises(ValueError, match="former name of fca"):
        polynya.RLClientConfig("tiny:qwen3", fca=False, zorro_inference=True)
    moved = old.replace(dtype="float32", model_name="tiny:llama", train={"seed": 5})
    assert (moved.sampling.dtype, moved.logprob.model, moved.sampling.seed, moved.sampling.fca) == (
        "float32", "tiny:llama", 5, False)
    assert old.replace(zorro_inference=True).sampling.fca is True


def test_overrides_reach_the_built_engines():
    """The settings users reported as ignored, checked on the engines a recipe builds."""
    from polynya.client.local import LocalClient

    cfg = _compose(["client.zorro_train=false", "client.fca=false", "client.train.micro_batch_tokens=777",
                    "client.train.temperature=0.5", "client.sampling.num_blocks=48"])
    client = LocalClient(to_client_config(cfg.client))
    try:
        t, (s,) = client.trainer.config, client.samplers
        assert (t.zorro, t.micro_batch_tokens, t.temperature, t.dtype) == (False, 777, 0.5, "float32")
        assert s.backend.runner.use_fca is False and s.backend.runner.num_blocks == 48
        assert next(client.trainer.module.parameters()).dtype == polynya.config.DTYPES["float32"]
    finally:
        client.shutdown()


def test_cpu_threads_is_the_one_thread_setting(monkeypatch):
    import torch
    from polynya.cluster.workers import actor_device

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert actor_device("cpu", 3) == "cpu" and calls == [3]  # a Ray actor on the CPU
    cfg = polynya.RLClientConfig("tiny:qwen3", comm_protocol="http", server_url="http://127.0.0.1:9",
                                 cpu_threads=2)
    client = polynya.create_rl_client(cfg)  # a remote server: nothing built here
    client.shutdown()
    assert calls == [3, 2]
    with pytest.raises(ValueError, match="cpu_threads"):
        polynya.RLClientConfig("tiny:qwen3", cpu_threads=0)


@pytest.mark.parametrize("key", ["eval_every=2", "overwrite=true"])
def test_builtin_only_run_settings_are_rejected_by_other_frameworks(key, tmp_path):
    from polynya.recipes.frameworks import verl

    cfg = _compose(["framework=verl", "model=qwen3-0.6b", f"run.{key}", f"run.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match=f"framework=verl does not translate run.{key.split('=')[0]}"):
        verl.write_run(cfg, tmp_path / "verl")
    assert not (tmp_path / "verl").exists()


def test_a_changed_advantage_eps_is_refused_by_verl_whose_eps_is_fixed(tmp_path):
    from polynya.recipes.frameworks import verl

    cfg = _compose(["framework=verl", "model=qwen3-0.6b", "run.advantage_eps=1e-4", f"run.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match="framework=verl does not translate run.advantage_eps=0.0001: "
                                         "verl's GRPO adds a fixed 1e-06"):
        verl.write_run(cfg, tmp_path / "verl")
    assert not (tmp_path / "verl").exists()


@pytest.mark.parametrize("value, want", [("true", True), ("false", False), ("auto", "auto")])
def test_offload_trainer_takes_a_bool_or_auto(value, want):
    assert to_client_config(_compose([]).client).offload_trainer == "auto"
    assert to_client_config(_compose([f"client.offload_trainer={value}"]).client).offload_trainer == want
    with pytest.raises(ValueError, match="offload_trainer must be True, False or 'auto'"):
        to_client_config(_compose(["client.offload_trainer=sometimes"]).client)


@pytest.mark.parametrize("key", ["log_ratio_clip", "kl_clip"])
def test_loss_clamps_are_refused_by_verl_whose_clamps_are_fixed(tmp_path, key):
    from polynya.recipes.frameworks import verl

    cfg = _compose(["framework=verl", "model=qwen3-0.6b", f"client.train.loss_config.{key}=5.0",
                    f"run.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match=f"framework=verl does not translate client.train."
                                         f"loss_config.{key}=5.0: verl 0.9.1's losses clamp"):
        verl.write_run(cfg, tmp_path / "verl")
    assert not (tmp_path / "verl").exists()


@pytest.mark.parametrize("grad_clip, want", [("0.5", "0.5"), ("0", "1000000000.0")])
def test_no_clipping_reaches_verl_as_a_bound_no_norm_reaches(tmp_path, grad_clip, want):
    """polynya's grad_clip=0 (no clipping) went to verl as clip_grad=0, which verl's FSDP engine
    applies as a bound of 0 (every gradient zeroed) and the verl adapter now refuses."""
    from polynya.recipes.frameworks import verl

    cfg = _compose(["framework=verl", "model=qwen3-0.6b", f"client.train.optim.grad_clip={grad_clip}",
                    f"run.out_dir={tmp_path}"])
    overrides = verl.write_run(cfg, tmp_path / "verl")
    assert f"actor_rollout_ref.actor.optim.clip_grad={want}" in overrides

"""verl's own ppo_trainer.yaml composes with the README's overrides, verl validates it, and the
result translates to polynya's configs; bad values fail with polynya's errors."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import verl
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from omegaconf import open_dict
from polynya.adapters.verl.overrides import SWAP
from polynya.adapters.verl.rollout import sampler_config
from polynya.adapters.verl.settings import DeepSpeedActorConfig, DeepSpeedEngineConfig, train_config
from verl.utils.config import omega_conf_to_dataclass, validate_config

RUN = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
       "trainer.n_gpus_per_node=1", "algorithm.adv_estimator=grpo"]


def compose_verl(*overrides: str):
    conf = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=conf, version_base=None):
        return compose("ppo_trainer", overrides=[*SWAP, *RUN, *overrides])


def worker_ref_config(cfg):
    """What verl's ActorRolloutRefWorker.init_model does to the ref section before converting it
    (verl/workers/engine_workers.py, "1. build reference model")."""
    ref = cfg.actor_rollout_ref.ref
    with open_dict(ref):
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return ref


def test_swap_composes_and_verl_validates_it():
    cfg = compose_verl("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.deepspeed.zero_stage=3",
                       "actor_rollout_ref.actor.optim.override_optimizer_config={eps:1e-3}")
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, DeepSpeedActorConfig) and actor.strategy == "deepspeed"
    assert isinstance(actor.engine, DeepSpeedEngineConfig) and actor.engine.zero_stage == 3
    assert actor.use_dynamic_bsz and cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz
    ref = omega_conf_to_dataclass(worker_ref_config(cfg))
    assert ref.strategy == "deepspeed" and ref.engine.forward_only and ref.engine.zero_stage == 3
    assert cfg.critic.strategy == "fsdp"  # no value-model engine in polynya: critic stays on FSDP
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert rollout.name == "polynya" and rollout.checkpoint_engine.backend == "polynya"

    # verl's worker fills the budget in before building the engine; then polynya's TrainConfig:
    actor.engine.max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    model = SimpleNamespace(path="Qwen/Qwen3-0.6B", local_path="/models/qwen3", lora_rank=0,
                            enable_gradient_checkpointing=True)
    tc = train_config(model, actor.engine, actor.optim)
    assert (tc.model, tc.zero_stage, tc.zorro, tc.dtype, tc.seed) == ("/models/qwen3", 3, True, "bfloat16", 42)
    assert tc.lr == pytest.approx(cfg.actor_rollout_ref.actor.optim.lr)
    assert tc.optim.grad_clip == 1.0 and tc.optim.weight_decay == pytest.approx(0.01) and tc.optim.eps == 1e-3
    assert tc.micro_batch_tokens == 16384 and tc.gradient_checkpointing
    sc = sampler_config(rollout, "/models/qwen3")
    assert sc.model == "/models/qwen3" and sc.max_model_len == rollout.prompt_length + rollout.response_length


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.deepspeed.zero_stage=5", "zero_stage"),
    ("actor_rollout_ref.actor.deepspeed.dtype=float16", "dtype"),
    ("actor_rollout_ref.actor.deepspeed.zorro_attention=dense", "zorro_attention"),
    ("actor_rollout_ref.actor.deepspeed.param_offload=true", "param_offload and optimizer_offload"),
    ("actor_rollout_ref.actor.deepspeed.compile_layers=1", "compile_layers must be a bool"),
])
def test_bad_engine_settings_fail_at_config_time(override, message):
    cfg = compose_verl(override)
    with pytest.raises((ValueError, InstantiationException), match=message):  # Hydra wraps it
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "constant"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps=10", "warm-up"),
    ("actor_rollout_ref.actor.optim.optimizer=AdamW8bit", "AdamW"),
    ("actor_rollout_ref.actor.optim.override_optimizer_config={foreach:false}", "only eps"),
    ("actor_rollout_ref.actor.use_dynamic_bsz=false", "use_dynamic_bsz"),
])
def test_settings_polynya_cannot_honour_are_refused(override, message):
    extra = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"] if "dynamic" in override else []
    cfg = compose_verl(override, *extra)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor.engine.use_dynamic_bsz = actor.use_dynamic_bsz  # as verl's worker does
    actor.engine.max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None
    model = SimpleNamespace(path="m", local_path=None, lora_rank=0)
    with pytest.raises(ValueError, match=message):
        train_config(model, actor.engine, actor.optim)


def test_compile_layers_reaches_the_train_config_and_is_checked():
    cfg = compose_verl("actor_rollout_ref.actor.deepspeed.compile_layers=true")
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor.engine.max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    model = SimpleNamespace(path="m", local_path=None, lora_rank=0)
    assert train_config(model, actor.engine, actor.optim).compile_layers is True
    assert omega_conf_to_dataclass(worker_ref_config(cfg)).engine.compile_layers is True  # the reference too
    cfg = compose_verl("actor_rollout_ref.actor.deepspeed.compile_layers=true",
                       "actor_rollout_ref.actor.deepspeed.zero_stage=3")
    with pytest.raises((ValueError, InstantiationException), match="ZeRO-3"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_multi_gpu_rollout_replica_is_refused():
    cfg = compose_verl("actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        sampler_config(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), "m")

"""verl's own ppo_trainer.yaml composes with the README's overrides, verl validates it, and the
result translates to polynya's configs; bad values fail with polynya's errors. Model-config
settings are checked on verl's real ``HFModelConfig`` of a saved model: what polynya would load
must be what verl builds (``override_config`` / ``hf_config_path``), else refused."""
from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import verl
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from omegaconf import open_dict
from polynya.adapters.verl.engine import DeepSpeedLMEngine
from polynya.adapters.verl.overrides import SWAP
from polynya.adapters.verl.rollout import sampler_config
from polynya.adapters.verl.settings import DeepSpeedActorConfig, DeepSpeedEngineConfig, train_config
from polynya.models import load_model, tiny_tokenizer
from transformers import AutoConfig
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import FSDPOptimizerConfig, HFModelConfig

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
                       "actor_rollout_ref.actor.optim.override_optimizer_config={eps:1e-3,fused:false}")
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
    assert tc.optim.fused is False  # verl's AdamW switch, passed on (default None: fused on CUDA)
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
    ("actor_rollout_ref.actor.optim.override_optimizer_config={foreach:false}", "only eps and fused"),
    ("actor_rollout_ref.actor.optim.override_optimizer_config={fused:1}",
     "override_optimizer_config.fused must be true or false"),
    ("actor_rollout_ref.actor.use_dynamic_bsz=false", "use_dynamic_bsz"),
    # verl's FSDP engine clips to 0 (zeroes every gradient); polynya's grad_clip=0 means no clipping
    ("actor_rollout_ref.actor.optim.clip_grad=0", "clip_grad must be > 0"),
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


@pytest.mark.parametrize("overrides, seeds", [
    ([], [42, 43, 45]),  # verl's default rollout.seed; replica r: seed + r, as verl's vLLM server
    (["actor_rollout_ref.rollout.seed=5"], [5, 6, 8]),
    (["+actor_rollout_ref.rollout.engine_kwargs.polynya.seed=100"], [100, 101, 103]),
])
def test_each_rollout_replica_gets_its_own_seed(overrides, seeds):
    rollout = omega_conf_to_dataclass(compose_verl(*overrides).actor_rollout_ref.rollout)
    assert [sampler_config(rollout, "m", replica_rank=r).seed for r in (0, 1, 3)] == seeds


@pytest.mark.parametrize("override, message", [
    ("+actor_rollout_ref.rollout.repetition_penalty=1.2", "repetition_penalty=1.0"),
    ("+actor_rollout_ref.rollout.engine_kwargs.polynya.seed=x", "engine_kwargs.polynya.seed must be an int"),
    # verl's vLLM would return log-probs of the raw logits (no temperature / filters) or logits
    ("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", "logprobs_mode=processed_logprobs"),
    ("actor_rollout_ref.rollout.logprobs_mode=processed_logits", "logprobs_mode=processed_logprobs"),
    # verl's vLLM would sample from an fp8 copy of the weights
    ("actor_rollout_ref.rollout.quantization=fp8", "rollout.quantization"),
    ("actor_rollout_ref.rollout.quantization_config_file=/q.json", "quantization_config_file"),
])
def test_rollout_settings_polynya_cannot_honour_are_refused(override, message):
    rollout = omega_conf_to_dataclass(compose_verl(override).actor_rollout_ref.rollout)
    with pytest.raises(ValueError, match=message):
        sampler_config(rollout, "m")


@pytest.mark.parametrize("overrides", [
    ["actor_rollout_ref.actor.checkpoint.load_contents=[model]"],  # resume weights, fresh optimizer
    ["actor_rollout_ref.actor.checkpoint.save_contents=[model,extra]"],  # load_contents follows it
])
def test_checkpoint_load_contents_short_of_what_polynya_restores_are_refused(overrides):
    """verl's engines resume only ``load_contents``; polynya's restores weights, optimizer state
    and schedule together, so a shorter list would resume a different run: refused at config
    time and by the engine itself (before anything is built)."""
    cfg = compose_verl(*overrides)
    with pytest.raises((ValueError, InstantiationException), match=r"checkpoint.load_contents=.*'optimizer'"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert omega_conf_to_dataclass(worker_ref_config(cfg)).engine.forward_only  # the reference never resumes
    checkpoint = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.checkpoint)
    engine = DeepSpeedEngineConfig(dtype="float32", zero_stage=0, use_dynamic_bsz=True, max_token_len_per_gpu=64)
    model = SimpleNamespace(path="m", local_path=None, lora_rank=0)
    with pytest.raises(ValueError, match="load_contents"):
        DeepSpeedLMEngine(model, engine, FSDPOptimizerConfig(lr=1e-6), checkpoint_config=checkpoint)


def test_checkpoint_contents_with_everything_pass():
    cfg = compose_verl("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).checkpoint.load_contents[:3] == \
        ["model", "optimizer", "extra"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3")
    load_model("tiny:qwen3", seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def engines():
    """(engine config, optimizer config) of the actor and of the reference (forward only)."""
    budget = dict(dtype="float32", zero_stage=0, use_dynamic_bsz=True, max_token_len_per_gpu=64)
    return [(DeepSpeedEngineConfig(**budget), FSDPOptimizerConfig(lr=1e-6)),
            (DeepSpeedEngineConfig(**budget, forward_only=True), None)]


@pytest.mark.parametrize("override, message", [
    ({"rms_norm_eps": 0.5}, r"rms_norm_eps=0\.5 \(the model's: 1e-06\)"),
    ({"model_config": {"attention_dropout": 0.1}}, r"attention_dropout=0\.1"),  # verl's nested form
    ({"no_such_field": 3}, r"no_such_field=3 \(the model's: absent\)"),
])
def test_model_override_config_that_changes_the_model_is_refused(model_dir, override, message):
    """verl builds its actor and reference from the overridden config; polynya loads the model's
    own, so such an override is refused for both engines (never trained on silently)."""
    model = HFModelConfig(path=model_dir, override_config=override)
    for engine, optim in engines():
        with pytest.raises(ValueError, match=f"actor_rollout_ref.model.override_config changes .*{message}"):
            train_config(model, engine, optim)
        with pytest.raises(ValueError, match=message):  # what verl's worker builds
            DeepSpeedLMEngine(model, engine, optim)


def test_model_overrides_that_change_nothing_pass(model_dir):
    """Values equal to the model's own, the attention implementation (polynya picks its kernels)
    and the special token ids pass; the model polynya loads then has verl's values."""
    own = AutoConfig.from_pretrained(model_dir)
    same = {"rms_norm_eps": own.rms_norm_eps, "num_hidden_layers": own.num_hidden_layers,
            "hidden_act": own.hidden_act}
    model = HFModelConfig(path=model_dir, override_config={**same, "attn_implementation": "eager",
                                                           "eos_token_id": 7, "pad_token_id": 1})
    for engine, optim in engines():
        assert train_config(model, engine, optim).model == model_dir
    loaded = load_model(model_dir).config
    for key in ("rms_norm_eps", "num_hidden_layers", "hidden_act", "hidden_size", "rope_parameters"):
        assert getattr(loaded, key) == getattr(model.hf_config, key), key


def test_hf_config_path_with_another_config_is_refused(model_dir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), copy)
    for engine, optim in engines():  # the model's own config elsewhere: the same model
        assert train_config(HFModelConfig(path=model_dir, hf_config_path=str(copy)), engine, optim).model == model_dir
    other = AutoConfig.from_pretrained(model_dir)
    other.rms_norm_eps = 0.25
    other.save_pretrained(tmp_path / "other")
    model = HFModelConfig(path=model_dir, hf_config_path=str(tmp_path / "other"))
    assert model.hf_config.rms_norm_eps == 0.25  # what verl would build its engines from
    for engine, optim in engines():
        with pytest.raises(ValueError, match=r"hf_config_path=.*rms_norm_eps=0\.25 \(the model's: 1e-06\)"):
            train_config(model, engine, optim)

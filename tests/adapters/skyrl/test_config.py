"""``train_config_from_skyrl`` on SkyRL 0.4.0's own ``TrainerConfig``: every scheduler name SkyRL
can pass to transformers' ``get_scheduler`` either gives polynya the same learning rate at every
optimizer step or is refused, and each setting that changes SkyRL's training numbers without a
polynya counterpart is refused by its key. (The rates the engine really applies: test_worker.py.)
"""
from __future__ import annotations

import itertools

import pytest
import torch
from polynya.adapters.skyrl import train_config_from_skyrl
from skyrl.train.config.config import TrainerConfig
from transformers.trainer import get_scheduler  # what SkyRL's fsdp_strategy.py builds with
from transformers.trainer_utils import SchedulerType

LR = 3e-4
MAPPED = ("constant", "constant_with_warmup", "cosine", "cosine_with_restarts")


def skyrl_trainer(**optim) -> TrainerConfig:
    t = TrainerConfig()
    t.algorithm.temperature = 0.7  # what SkyRL's validate_cfg copies from the generator
    t.policy.optimizer_config.lr = LR
    for k, v in optim.items():
        setattr(t.policy.optimizer_config, k, v)
    return t


def skyrl_lrs(trainer: TrainerConfig, num_training_steps: int, steps: int) -> list[float]:
    """The rate of each optimizer step under SkyRL: AdamW + ``get_scheduler`` exactly as
    ``FSDPStrategy._fsdp_init_train_model`` builds them, stepped as its ``optimizer_step``."""
    oc = trainer.policy.optimizer_config
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=oc.lr, betas=oc.adam_betas,
                            weight_decay=oc.weight_decay)
    sched = get_scheduler(oc.scheduler, opt, num_warmup_steps=oc.num_warmup_steps,
                          num_training_steps=num_training_steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("scheduler, warmup, total, steps", [
    ("constant", 4, 9, 4 + 3),  # transformers ignores the warm-up of "constant"
    ("constant", 0, 9, 3),
    ("constant_with_warmup", 0, 9, 3),
    ("cosine", 0, 7, 7),  # SkyRL runs exactly num_training_steps optimizer steps
    ("cosine_with_restarts", 0, 7, 7 + 3),
])
def test_lr_schedule_equals_skyrl(scheduler, warmup, total, steps):
    trainer = skyrl_trainer(scheduler=scheduler, num_warmup_steps=warmup)
    cfg = train_config_from_skyrl(trainer, "tiny:qwen3", num_training_steps=total)
    ours = [cfg.lr * cfg.optim.lr_factor(k) for k in range(steps)]
    want = skyrl_lrs(trainer, total, steps)
    assert ours == want  # exact, step for step
    if scheduler == "constant":
        assert ours[0] == LR  # no warm-up: the audit's case (polynya used to start at lr/5)
    if scheduler.startswith("cosine"):
        assert all(a > b for a, b in itertools.pairwise(ours[:total]))  # it does decay


def test_maps_optimizer_and_loss_settings():
    trainer = skyrl_trainer(adam_betas=[0.8, 0.95], weight_decay=0.05, max_grad_norm=0.5)
    trainer.algorithm.eps_clip_high = 0.28
    trainer.algorithm.kl_loss_coef = 0.02
    trainer.algorithm.kl_estimator_type = "k2"
    trainer.algorithm.tis_imp_ratio_cap = 2.0  # without use_tis SkyRL never reads it
    cfg = train_config_from_skyrl(trainer, "tiny:qwen3", dtype="float32", zero_stage=0)
    assert (cfg.lr, cfg.temperature, cfg.loss, cfg.dtype, cfg.zero_stage) == (LR, 0.7, "ppo", "float32", 0)
    o = cfg.optim
    assert (o.betas, o.weight_decay, o.grad_clip, o.schedule, o.warmup_steps) == (
        (0.8, 0.95), 0.05, 0.5, "constant", 0)
    lc = cfg.loss_config
    assert (lc.clip_low, lc.clip_high, lc.norm, lc.kl_norm, lc.kl_coef, lc.kl_estimator) == (
        0.2, 0.28, "sum", "sequence", 0.02, "k2")
    cos = train_config_from_skyrl(skyrl_trainer(scheduler="cosine"), "tiny:qwen3", num_training_steps=40)
    assert (cos.optim.schedule, cos.optim.total_steps, cos.optim.warmup_steps, cos.optim.min_lr_ratio) == (
        "warmup_cosine", 40, 0, 0.0)


@pytest.mark.parametrize("name", [s.value for s in SchedulerType if s.value not in MAPPED])
def test_other_schedulers_refused(name):
    with pytest.raises(ValueError, match=rf"optimizer_config.scheduler='{name}' is not supported"):
        train_config_from_skyrl(skyrl_trainer(scheduler=name), "tiny:qwen3", num_training_steps=10)


@pytest.mark.parametrize("scheduler", ["constant_with_warmup", "cosine", "cosine_with_restarts"])
def test_warmup_refused(scheduler):
    # transformers: 0, 1/4, 2/4, 3/4 of lr; polynya's warm-up: 1/5, 2/5, ... -> refused, not shifted
    with pytest.raises(ValueError, match=rf"num_warmup_steps=4 with scheduler='{scheduler}'.*step/N"):
        train_config_from_skyrl(skyrl_trainer(scheduler=scheduler, num_warmup_steps=4), "tiny:qwen3",
                                num_training_steps=10)


def test_schedule_arguments_checked():
    with pytest.raises(ValueError, match=r"scheduler='cosine' needs .*num_training_steps"):
        train_config_from_skyrl(skyrl_trainer(scheduler="cosine"), "tiny:qwen3")
    with pytest.raises(ValueError, match=r"num_training_steps must be an int >= 1, got 0"):
        train_config_from_skyrl(skyrl_trainer(scheduler="cosine"), "tiny:qwen3", num_training_steps=0)
    with pytest.raises(ValueError, match=r"optimizer_config.num_warmup_steps must be an int >= 0, got -1"):
        train_config_from_skyrl(skyrl_trainer(scheduler="constant", num_warmup_steps=-1), "tiny:qwen3")


def _lora(t):
    t.policy.model.lora.rank = 16


def _support_replay(t):
    t.algorithm.enable_sample_support_replay = True


def _use_tis(t):
    t.algorithm.use_tis = True
    t.algorithm.tis_imp_ratio_cap = 2.0


def _no_temperature(t):
    t.algorithm.temperature = None


def _model_kwargs(t):
    t.policy.model_config_kwargs = {"attention_dropout": 0.1}


def _mtp(t):
    t.mtp.enabled = True


def _int4(t):
    t.policy.model.fake_int4_qat.enabled = True


@pytest.mark.parametrize("change, message", [
    pytest.param(_lora, r"trainer\.policy\.model\.lora\.rank=16 \(LoRA\) is not supported", id="lora"),
    pytest.param(_support_replay, r"trainer\.algorithm\.enable_sample_support_replay=true",
                 id="sample_support_replay"),
    pytest.param(_use_tis, r"trainer\.algorithm\.use_tis=true .*tis_imp_ratio_cap", id="use_tis"),
    pytest.param(_no_temperature, r"trainer\.algorithm\.temperature is unset", id="temperature"),
    pytest.param(_model_kwargs, r"trainer\.policy\.model_config_kwargs=\{'attention_dropout': 0\.1\}",
                 id="model_config_kwargs"),
    pytest.param(_mtp, r"trainer\.mtp\.enabled=true", id="mtp"),
    pytest.param(_int4, r"trainer\.policy\.model\.fake_int4_qat\.enabled=true", id="fake_int4_qat"),
])
def test_settings_that_change_training_refused(change, message):
    trainer = skyrl_trainer()
    train_config_from_skyrl(trainer, "tiny:qwen3")  # accepted before the change
    change(trainer)
    with pytest.raises(ValueError, match=message):
        train_config_from_skyrl(trainer, "tiny:qwen3")


def test_dict_config_refusals():
    """The same keys are read from a plain dict of SkyRL's shape (as the worker tests pass)."""
    base = {"algorithm": {"temperature": 1.0}, "policy": {"optimizer_config": {"lr": LR}}}
    assert train_config_from_skyrl(base, "tiny:qwen3").optim.schedule == "constant"
    with pytest.raises(ValueError, match=r"lora\.rank=8"):
        train_config_from_skyrl({**base, "policy": {"model": {"lora": {"rank": 8}}}}, "tiny:qwen3")
    with pytest.raises(ValueError, match=r"trainer\.algorithm\.temperature is unset"):
        train_config_from_skyrl({"policy": base["policy"]}, "tiny:qwen3")
    with pytest.raises(ValueError, match=r"use_tis=true"):
        train_config_from_skyrl({**base, "algorithm": {"temperature": 1.0, "use_tis": True}}, "tiny:qwen3")

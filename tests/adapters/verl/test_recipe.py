"""``polynya-recipe framework=verl task=gsm8k`` writes a verl run that verl's own config accepts,
with the recipe's settings translated and the task's own reward."""
from __future__ import annotations

import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import verl
from hydra import compose, initialize_config_dir, initialize_config_module
from polynya.adapters.verl.reward import compute_score
from polynya.adapters.verl.settings import DeepSpeedActorConfig
from polynya.recipes.frameworks import run
from polynya.recipes.schema import register
from polynya.recipes.tasks import gsm8k
from verl.utils.config import omega_conf_to_dataclass, validate_config

RECIPE = ["framework=verl", "task=gsm8k", "model=qwen3-0.6b", "run.steps=7", "run.prompts_per_step=4",
          "run.group_size=5", "run.max_new_tokens=96", "client.train.lr=3e-6", "client.train.loss=dapo",
          "client.train.loss_config.kl_coef=0.01"]


def recipe(tmp_path, *extra):
    register()
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        return compose("config", overrides=[*RECIPE, f"run.out_dir={tmp_path}", *extra])


def test_written_run_composes_in_verl_with_the_recipes_settings(tmp_path):
    run(recipe(tmp_path))
    out = tmp_path / "verl"
    overrides = (out / "overrides.txt").read_text().split("\n")[:-1]
    assert (out / "run.sh").read_text().count("actor_rollout_ref.rollout.name=polynya") == 1
    conf = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=conf, version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert (a.strategy, r.name, r.checkpoint_engine.backend) == ("deepspeed", "polynya", "polynya")
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-0.6B"
    assert (cfg.data.train_batch_size, r.n, cfg.data.max_response_length, cfg.trainer.total_training_steps) == (4, 5, 96, 7)
    assert a.optim.lr == pytest.approx(3e-6) and a.ppo_mini_batch_size == 4 and a.ppo_epochs == 1
    assert (a.loss_agg_mode, a.clip_ratio_low, a.clip_ratio_high) == ("token-mean", 0.2, 0.28)  # DAPO
    assert a.use_kl_loss and a.kl_loss_coef == pytest.approx(0.01) and a.kl_loss_type == "low_var_kl"
    assert isinstance(omega_conf_to_dataclass(a), DeepSpeedActorConfig) and a.deepspeed.zero_stage == 2
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.reward.custom_reward_function.reward_kwargs == {"convention": "verl", "method": "strict",
                                                               "format_score": 0.0}  # the task yaml

    rows = pq.read_table(cfg.data.train_files).to_pylist()
    examples = gsm8k.load("train")
    assert len(rows) == len(examples) and rows[0]["prompt"] == [{"role": "user", "content": examples[0].prompt}]
    row, ex = rows[3], examples[3]
    kw = dict(cfg.reward.custom_reward_function.reward_kwargs)
    for text in (f"... so #### {ex.answer}", "#### 123456789", "no number"):
        got = compute_score(row["data_source"], text, row["reward_model"]["ground_truth"], row["extra_info"], **kw)
        assert got == gsm8k.reward(text, ex, **kw)
    assert compute_score(row["data_source"], f"#### {ex.answer}", row["reward_model"]["ground_truth"],
                         row["extra_info"], **kw) == 1.0


@pytest.mark.parametrize("extra, message", [
    (["model=tiny"], "HF id or a local directory"),
    (["task.chat_template=false"], "chat template"),
])
def test_untranslatable_recipes_are_refused(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        run(recipe(tmp_path, *extra))
    assert not (tmp_path / "verl" / "overrides.txt").exists()


def test_cli_writes_the_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polynya.recipes", *RECIPE, f"run.out_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verl run written to" in proc.stdout and (tmp_path / "verl" / "run.sh").exists()


def test_a_completion_the_reward_cannot_judge_stops_the_run_naming_it(monkeypatch):
    """A reward that raises or returns NaN is a ``ValueError`` naming the prompt (verl has no way
    to leave one completion out of its group; a NaN would make the whole group's advantages NaN)."""
    info = {"prompt": "What is 2 + 2?", "meta": "{}"}
    assert compute_score("gsm8k", "#### 4", "4", info) == 1.0
    for bad in (float("nan"), float("inf")):
        monkeypatch.setattr(gsm8k, "reward", lambda *a, bad=bad, **k: bad)
        with pytest.raises(ValueError, match=r"gsm8k reward could not judge a completion of "
                                             r"'What is 2 \+ 2\?': reward (nan|inf) is not finite"):
            compute_score("gsm8k", "#### 4", "4", info)

    def broken(*a, **k):
        raise RuntimeError("worker crashed")

    monkeypatch.setattr(gsm8k, "reward", broken)
    with pytest.raises(ValueError, match="RuntimeError: worker crashed"):
        compute_score("gsm8k", "#### 4", "4", info)

"""``polynya-recipe framework=trl``: the toy task through TRL's GRPOTrainer on polynya's engines
learns (mean reward rises), with the built-in driver's metrics file."""
import json
import math

import pytest
from hydra import compose, initialize_config_module

pytest.importorskip("trl")

from polynya.recipes.frameworks import run
from polynya.recipes.frameworks.trl import reward_function
from polynya.recipes.schema import register
from polynya.recipes.tasks import toy

register()


@pytest.mark.slow
def test_toy_task_learns_through_trl(tmp_path):
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        cfg = compose("config", overrides=["framework=trl", "task=toy", f"run.out_dir={tmp_path}",
                                           "run.progress=false"])
    run(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(cfg.run.steps))
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.08, (first, last)  # measured: 0.032 -> 0.200
    assert all(r["entropy"] > 0 and "loss" in r for r in rows)


def _trl(tmp_path, *extra):
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        cfg = compose("config", overrides=["framework=trl", "task=toy", f"run.out_dir={tmp_path}",
                                           "run.prompts_per_step=2", "run.group_size=2",
                                           "run.max_new_tokens=4", "run.checkpoint_every=1",
                                           "run.progress=false", *extra])
    run(cfg)
    return [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]


def test_a_resumed_trl_run_keeps_its_metrics_and_a_second_run_never_overwrites_it(tmp_path):
    """Resuming kept only the steps after the checkpoint in metrics.jsonl; run.resume=false
    started a second run in the same directory, mixing its checkpoints with the first's."""
    assert _trl(tmp_path, "run.steps=2") == [0, 1]
    assert _trl(tmp_path, "run.steps=3") == [0, 1, 2]  # resumed at TRL's checkpoint-2
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="already holds a run.*run.resume=false"):
        _trl(tmp_path, "run.steps=1", "run.resume=false")
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*"))[-1] == "checkpoint-3"


def test_unjudgeable_completions_reach_trl_as_none_naming_the_prompt(capsys):
    """TRL 1.16 leaves a completion every reward function returned None for out of its group's
    mean and std (advantage 0); a NaN it would nansum to 0 and an exception would end the run."""
    class Flaky:
        NAME = "toy"

        def reward(self, completion, example, **kw):
            if completion == "raise":
                raise ValueError("cannot judge")
            return {"nan": math.nan, "inf": math.inf}.get(completion, toy.reward(completion, example))

    examples = toy.load("train")
    fn = reward_function(Flaky(), examples, {})
    assert fn.__name__ == "toy_reward"
    got = fn(["7777", [{"content": "raise"}], "nan", "inf", "12"], [7, 3, 3, 4, 1])
    assert got == [toy.reward("7777", examples[7]), None, None, None, toy.reward("12", examples[1])]
    out = capsys.readouterr().out
    assert "3 of 5 completions could not be judged" in out
    assert f"train example 3 ({examples[3].prompt.strip()!r}): ValueError: cannot judge" in out
    assert fn(["7", "1"], [7, 1]) == [toy.reward("7", examples[7]), toy.reward("1", examples[1])]
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("override, message", [
    ("run.advantage_eps=1e-3",
     "framework=trl does not translate run.advantage_eps=0.001: trl's GRPO adds a fixed 0.0001"),
    ("client.train.loss_config.log_ratio_clip=20.0",
     "framework=trl does not translate client.train.loss_config.log_ratio_clip=20.0: TRL's "
     "GRPOTrainer clamps neither"),
])
def test_settings_trl_cannot_take_are_refused(tmp_path, override, message):
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        cfg = compose("config", overrides=["framework=trl", "task=toy", f"run.out_dir={tmp_path}",
                                           override])
    with pytest.raises(ValueError, match=message):
        run(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()

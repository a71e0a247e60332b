"""``polynya-recipe framework=trl``: the toy task through TRL's GRPOTrainer on polynya's engines
learns (mean reward rises), with the built-in driver's metrics file."""
import json

import pytest
from hydra import compose, initialize_config_module

pytest.importorskip("trl")

from polynya.recipes.frameworks import run
from polynya.recipes.schema import register

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

"""A recipe run killed after a checkpoint and resumed equals the run that was never stopped:
every metric of every step after the checkpoint (rewards of the prompts drawn and sampled,
loss, grad norm, lr, eval at the same steps) and the final weights, on ZeRO 0, 2 and 3; and a
resume that would train with another lr or optimizer is refused before any engine is built."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from hydra import compose, initialize_config_module

from polynya.recipes import checkpoint
from polynya.recipes.driver import GRPODriver
from polynya.recipes.schema import register

register()
SMALL = ["run.prompts_per_step=2", "run.group_size=2", "run.max_new_tokens=4", "run.progress=false",
         "run.keep_checkpoints=5"]


def _run(out, *extra) -> dict:
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        cfg = compose("config", overrides=[f"run.out_dir={out}", *SMALL, *extra])
    return GRPODriver(cfg).run()


def _rows(out) -> list[dict]:
    with open(os.path.join(out, checkpoint.METRICS)) as f:  # timings are the only things allowed to differ
        return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")} for line in f]


def _hf_weights(result) -> bytes:
    with open(os.path.join(result["model"], "model.safetensors"), "rb") as f:
        return f.read()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_killed_run_resumed_equals_the_uninterrupted_run(tmp_path, stage):
    run = ["run.steps=3", "run.checkpoint_every=1", "run.eval_every=2", "run.eval_examples=3",
           "run.eval_greedy=false", f"client.train.zero_stage={stage}",
           "client.train.optim.schedule=warmup_cosine", "client.train.optim.warmup_steps=1",
           "client.train.optim.total_steps=5"]
    whole = _run(tmp_path / "whole", *run)
    killed = tmp_path / "killed"  # killed after step 1's checkpoint: steps 1-2 logged, not saved
    shutil.copytree(tmp_path / "whole", killed)
    for step in (2, 3):
        shutil.rmtree(checkpoint.checkpoint_dir(str(killed), step))
    resumed = _run(killed, *run)
    assert resumed["start_step"] == 1 and resumed["steps"] == 2
    rows = _rows(tmp_path / "whole")
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval_reward_mean" in rows[1] and "eval_reward_mean" in rows[2]
    assert len({r["lr"] for r in rows}) == 3  # the schedule moves: an lr restored wrong shows
    assert _rows(killed) == rows
    assert _hf_weights(resumed) == _hf_weights(whole)


def test_a_resume_with_another_lr_or_optimizer_is_refused_before_building(tmp_path):
    first = _run(tmp_path, "run.steps=1", "client.train.optim.eps=1e-6")
    before = open(first["metrics_path"]).read()
    for change, match in (("client.train.lr=0.02", "lr: 0.01 there, 0.02 now"),
                          ("client.train.optim.eps=1e-5", "optim: .*'eps': 1e-06.* there, .*'eps': 1e-05")):
        with pytest.raises(ValueError, match="holds a run with other settings.*" + match):
            _run(tmp_path, "run.steps=2", "client.train.optim.eps=1e-6", change)
        assert open(first["metrics_path"]).read() == before

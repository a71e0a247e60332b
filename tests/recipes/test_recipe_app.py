"""The Hydra recipe app: every shipped YAML composes into valid engine configs; each task runs
end to end on the tiny model; a killed run resumes from its checkpoint; GRPO advantages."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from polynya import SamplingParams

from polynya.recipes.driver import GRPODriver, group_advantages
from polynya.recipes.schema import register, to_client_config

CONF = Path(__file__).resolve().parents[2] / "recipes" / "conf"
GROUPS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml")) for g in ("task", "model", "framework", "placement")}
register()


def _compose(overrides):
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_yaml_composes_into_valid_configs(group, option):
    cfg = _compose([f"{group}={option}"])
    client = to_client_config(cfg.client)
    assert client.train.model == client.model_name == client.sampling.model
    assert cfg.task.name and cfg.run.steps > 0


def test_bad_override_is_rejected_by_the_engine_schema():
    cfg = _compose(["client.train.zero_stage=7"])
    with pytest.raises(ValueError, match="zero_stage"):
        to_client_config(cfg.client)


def _run(tmp_path, task, *extra):
    cfg = _compose([f"task={task}", f"run.out_dir={tmp_path / task}", "run.steps=2", "run.prompts_per_step=2",
                    "run.group_size=2", "run.max_new_tokens=4", "run.progress=false", *extra])
    return GRPODriver(cfg).run()


@pytest.mark.parametrize("task", ["toy", "gsm8k", "txt2sql", "longqa"])
def test_two_steps_of_each_task_write_metrics(tmp_path, task):
    extra = ["task.max_prompt_tokens=8000", "run.prompts_per_step=1"] if task == "longqa" else []
    out = _run(tmp_path, task, *extra)
    rows = [json.loads(line) for line in open(out["metrics_path"])]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["generate_s"] > 0 and "loss" in r and "grad_norm" in r


def test_ray_colocated_placement_runs_on_cpu(tmp_path, monkeypatch):
    """No GPU here: the Ray client stands a custom resource in for each device."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    import ray

    try:
        out = _run(tmp_path, "toy", "placement=colocated", "run.steps=1")
    finally:
        ray.shutdown()
    assert [json.loads(line)["step"] for line in open(out["metrics_path"])] == [0]


def test_killed_run_resumes_from_latest_checkpoint(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "polynya.recipes", f"run.out_dir={out}", "run.steps=100000",
           "run.checkpoint_every=1", "run.prompts_per_step=2", "run.group_size=2", "run.max_new_tokens=4",
           "run.progress=false"]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        def checkpointed():  # a complete checkpoint past step 2 (older ones get pruned)
            return [p for p in out.glob("checkpoints/*/MANIFEST.json") if int(p.parent.name[5:]) >= 2]

        while time.time() < deadline and not checkpointed():
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        assert checkpointed(), "no checkpoint within 240 s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    latest = max(int(json.load(open(p.parent / "driver.json"))["next_step"])  # complete ones
                 for p in out.glob("checkpoints/*/MANIFEST.json"))
    cfg = _compose([f"run.out_dir={out}", f"run.steps={latest + 1}", "run.prompts_per_step=2",
                    "run.group_size=2", "run.max_new_tokens=4", "run.progress=false"])
    result = GRPODriver(cfg).run()
    assert result["start_step"] == latest and result["steps"] == 1
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(latest + 1)), "every step logged exactly once"


def test_a_second_run_never_overwrites_the_first(tmp_path):
    first = _run(tmp_path, "toy", "run.steps=1", "run.resume=false")
    before = open(first["metrics_path"]).read()
    with pytest.raises(ValueError, match="already holds a run.*run.overwrite=true"):
        _run(tmp_path, "toy", "run.steps=1", "run.resume=false")
    assert open(first["metrics_path"]).read() == before  # refused before touching anything
    done = _run(tmp_path, "toy", "run.steps=1")  # resume: the run is complete, nothing to do
    assert done["steps"] == 0 and done["model"] == first["model"]
    assert open(first["metrics_path"]).read() == before
    again = _run(tmp_path, "toy", "run.steps=1", "run.resume=false", "run.overwrite=true")
    rows = [json.loads(line) for line in open(again["metrics_path"])]
    assert [r["step"] for r in rows] == [0]


def test_run_evaluates_and_ends_with_a_loadable_model(tmp_path, capfd):
    from transformers import AutoModelForCausalLM

    import polynya

    out = _run(tmp_path, "toy", "run.steps=2", "run.eval_every=1", "run.eval_examples=5")
    rows = [json.loads(line) for line in open(out["metrics_path"])]
    for r in rows:
        assert r["eval_examples"] == 5 and 0.0 <= r["eval_pass_at_1"] <= r["eval_reward_mean"] + 1 \
            and 0.0 <= r["eval_reward_mean"] <= 1.0
    last = capfd.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"model: {out['model']} ") and out["model"].endswith("step_000002/engine/hf")
    model = AutoModelForCausalLM.from_pretrained(out["model"], dtype=torch.float32)
    batch = polynya.RolloutBatch([[5, 6, 7, 8]] * 2, [[9, 10, 11], [12]])
    with torch.no_grad():
        got = polynya.compute_logprobs(model, batch).logprobs
        init = polynya.compute_logprobs(polynya.models.load_model("tiny:qwen3"), batch).logprobs
    assert (got - init).abs().max() > 1e-4  # the trained weights, not the initial ones


@pytest.mark.parametrize("key, value", [("eval_every", -1), ("group_size", 0), ("eval_examples", -2)])
def test_bad_run_values_are_rejected(key, value):
    with pytest.raises(ValueError, match=f"run.{key} must be an integer"):
        GRPODriver(_compose([f"run.{key}={value}"]))


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0])
    a = group_advantages(r, 2, scale=False, eps=0.0)
    assert torch.allclose(a, torch.tensor([0.5, -0.5, 0.0, 0.0, -1.0, 1.0]))
    s = group_advantages(r, 2, scale=True, eps=1e-6)
    assert torch.allclose(s, torch.tensor([1.0, -1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-4)


@pytest.mark.slow
def test_toy_task_reward_goes_up(tmp_path):
    """Seed 0, 20 steps of 8 prompts x 8 samples: the mean reward of the last 5 steps beats the
    first 5 by more than 0.05 (measured: ~0.03 -> ~0.18)."""
    cfg = _compose([f"run.out_dir={tmp_path}", "run.steps=20", "run.progress=false", "run.seed=0"])
    history = GRPODriver(cfg).run()["history"]
    first = sum(h["reward_mean"] for h in history[:5]) / 5
    last = sum(h["reward_mean"] for h in history[-5:]) / 5
    assert last > first + 0.05, (first, last)


def test_a_resume_with_other_data_settings_is_refused(tmp_path):
    """A resumed run's later steps would draw other prompts or seeds: refused before any engine
    is built, naming each setting."""
    first = _run(tmp_path, "toy", "run.steps=1", "run.checkpoint_every=1")
    before = open(first["metrics_path"]).read()
    with pytest.raises(ValueError, match="group_size: 2 there, 3 now.*seed: 0 there, 5 now"):
        _run(tmp_path, "toy", "run.steps=2", "run.seed=5", "run.group_size=3")
    assert open(first["metrics_path"]).read() == before
    again = _run(tmp_path, "toy", "run.steps=2", "run.checkpoint_every=1")  # same settings: resumes
    assert again["start_step"] == 1 and again["steps"] == 1


def test_each_prompt_of_a_step_samples_from_its_own_seed():
    """One seed for a step gave sample j of every prompt the same random stream (correlated
    rollouts across the step's groups); per-prompt seeds draw them independently."""
    from polynya.config import SamplerConfig
    from polynya.engines import SamplingEngine
    from polynya.recipes.seeds import per_prompt

    engine = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu", block_size=4, num_blocks=256))
    prompts = [[5 + k, 40, 41, 42] for k in range(12)]  # 12 prompts that differ in their first token
    base = SamplingParams(n=4, temperature=1.0, max_tokens=1, stop_token_ids=())

    def agreement(params) -> float:
        firsts = [[s.token_ids[0] for s in group] for group in engine.generate(prompts, params)]
        pairs = [(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1:]]
        return sum(x == y for a, b in pairs for x, y in zip(a, b)) / (len(pairs) * base.n)

    shared = agreement(dataclasses.replace(base, seed=7))
    own = agreement(per_prompt(base, "train", 0, 7, len(prompts)))
    assert shared > 0.3 and own < 0.05, (shared, own)
    assert per_prompt(base, "train", 0, 7, 3) == per_prompt(base, "train", 0, 7, 3)  # reproducible
    assert len({p.seed for p in per_prompt(base, "train", 0, 7, 64) + per_prompt(base, "eval", 0, 7, 64)}) == 128

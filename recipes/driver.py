"""The built-in GRPO driver: prompts -> generate n -> rewards -> group advantages ->
(reference log-probs) -> train -> sync, through the public client only.

    driver = GRPODriver(cfg)          # cfg: a composed RecipeConfig (see schema.py)
    summary = driver.run()            # per-step metrics in <out_dir>/metrics.jsonl

Each step is a pure function of (seed, step) for its data, so a run resumed from a checkpoint
continues exactly where the killed one stopped. ``run.eval_every`` adds held-out metrics
(``evaluate.py``) to the step's row. The last step is always checkpointed; with
``client.train.export_hf`` (default) the checkpoint holds a Hugging Face export of the model
(``<out_dir>/checkpoints/step_N/engine/hf``), and the run's last line says where it is.

An ``out_dir`` that already holds a run (``metrics.jsonl`` or checkpoints) is never silently
overwritten: with ``run.resume`` (default) and a checkpoint the run continues from it (a run
that already reached ``run.steps`` only reports its model); otherwise the run refuses before
building anything, unless ``run.overwrite=true`` (which deletes the old metrics, checkpoints
and TensorBoard logs first).
"""
from __future__ import annotations

import os
import random
import time

import torch

from .. import RolloutBatch, SamplingParams, create_rl_client
from ..models import load_tokenizer
from . import checkpoint
from .evaluate import Evaluator
from .metrics import MetricsLogger
from .schema import to_client_config
from .seeds import per_prompt
from .tasks import Example, get_task
from .tasks.common import judge


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool, eps: float) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's std if ``scale``.

    Args: rewards ``[num_prompts * group_size]`` laid out group by group. Returns the same shape.
    """
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv.flatten()


def check_run(rc) -> None:
    """``ValueError`` for run-section values the loop cannot use."""
    for name in ("steps", "checkpoint_every", "eval_every", "eval_examples"):
        if isinstance(rc[name], bool) or not isinstance(rc[name], int) or rc[name] < 0:
            raise ValueError(f"run.{name} must be an integer >= 0, got {rc[name]!r}")
    for name in ("prompts_per_step", "group_size", "max_new_tokens", "keep_checkpoints"):
        if isinstance(rc[name], bool) or not isinstance(rc[name], int) or rc[name] < 1:
            raise ValueError(f"run.{name} must be an integer >= 1, got {rc[name]!r}")


class GRPODriver:
    def __init__(self, cfg):
        check_run(cfg.run)
        self.cfg = cfg
        self.run_cfg = cfg.run
        self.task = get_task(cfg.task.name)
        self.client_config = to_client_config(cfg.client)
        self.tokenizer = load_tokenizer(self.client_config.model_name)
        self.examples, self.prompt_ids = self._load_prompts(cfg.task.train_split)
        self.out_dir = cfg.run.out_dir
        self.reward_kwargs = dict(cfg.task.reward)
        self.evaluator = self._evaluator() if cfg.run.eval_every else None
        self._warned = False
        if self.client_config.comm_protocol == "http" and self.client_config.server_url is None \
                and self.client_config.run_dir is None:  # the embedded server saves under out_dir
            self.client_config = self.client_config.replace(run_dir=os.path.abspath(self.out_dir))
        self.kl = self.client_config.train.loss_config.kl_coef > 0
        if self.kl and not self.client_config.reference_model:
            self.client_config = self.client_config.replace(reference_model=True)

    # ------------------------------------------------------------------ data
    def _encode(self, text: str) -> list[int]:
        if self.cfg.task.chat_template and getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _load_prompts(self, split: str, limit: int = 0) -> tuple[list[Example], list[list[int]]]:
        examples = self.task.load(split, self.cfg.task.source)
        kept, ids = [], []
        for ex in examples:
            toks = self._encode(ex.prompt)
            if 0 < len(toks) <= self.cfg.task.max_prompt_tokens:
                kept.append(ex)
                ids.append(toks)
            if limit and len(kept) == limit:
                break
        if not kept:
            raise ValueError(f"no {self.cfg.task.name} prompt fits task.max_prompt_tokens="
                             f"{self.cfg.task.max_prompt_tokens}")
        return kept, ids

    def _evaluator(self) -> Evaluator:
        rc = self.run_cfg
        examples, ids = self._load_prompts(rc.eval_split, rc.eval_examples)
        return Evaluator(self.task, examples, ids, tokenizer=self.tokenizer,
                         reward_kwargs=self.reward_kwargs, max_new_tokens=rc.max_new_tokens,
                         greedy=rc.eval_greedy, temperature=self.client_config.train.temperature,
                         seed=rc.seed)

    def _pick(self, step: int) -> list[int]:
        rng = random.Random(self.run_cfg.seed * 1_000_003 + step)
        n = min(self.run_cfg.prompts_per_step, len(self.examples))
        return rng.sample(range(len(self.examples)), n)

    # ------------------------------------------------------------------ one step
    def step(self, client, step: int, phase=lambda text: None) -> dict:
        rc, times = self.run_cfg, {}
        idx = self._pick(step)
        prompts = [self.prompt_ids[i] for i in idx]
        params = per_prompt(SamplingParams(n=rc.group_size, temperature=self.client_config.train.temperature,
                                           top_p=rc.top_p, top_k=rc.top_k, max_tokens=rc.max_new_tokens),
                            "train", rc.seed, step, len(prompts))
        phase(f"generating {len(prompts)} x {rc.group_size} samples")
        t = time.perf_counter()
        groups = client.generate(prompts, params)
        times["generate_s"] = time.perf_counter() - t

        responses, rewards, truncated, reward_errors = [], [], 0, 0
        for i, samples in zip(idx, groups):
            for s in samples:
                reward = self._reward(s.token_ids, self.examples[i])
                reward_errors += reward is None
                rewards.append(0.0 if reward is None else reward)
                responses.append(s.token_ids)
                truncated += s.finish_reason == "length"
        rewards_t = torch.tensor(rewards)
        adv = group_advantages(rewards_t, rc.group_size, scale=rc.scale_advantages, eps=rc.advantage_eps)
        batch = RolloutBatch([p for p in prompts for _ in range(rc.group_size)], responses,
                             group_ids=[g for g in range(len(prompts)) for _ in range(rc.group_size)],
                             advantages=adv)
        if self.kl:
            phase("reference log-probs")
            t = time.perf_counter()
            batch.ref_logprobs = client.compute_logprobs(batch, model="reference").logprobs
            times["logprobs_s"] = time.perf_counter() - t

        phase("training")
        t = time.perf_counter()
        train = client.forward_backward(batch)
        train.update(client.step())
        times["train_s"] = time.perf_counter() - t
        phase("syncing weights")
        t = time.perf_counter()
        client.sync_weights()
        times["sync_s"] = time.perf_counter() - t
        return dict(reward_mean=rewards_t.mean().item(), reward_std=rewards_t.std(unbiased=False).item(),
                    reward_max=rewards_t.max().item(),
                    response_len=sum(map(len, responses)) / len(responses),
                    truncated_frac=truncated / len(responses), reward_errors=reward_errors,
                    **{k: v for k, v in train.items() if isinstance(v, (int, float))},
                    **times, step_s=sum(times.values()))

    def _reward(self, token_ids: list[int], example: Example) -> float | None:
        """The task's reward of one completion; None (scored 0, counted in ``reward_errors``)
        when it cannot be judged: one odd completion must never end a run."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        r, why = judge(self.task, text, example, self.reward_kwargs)
        if why is not None and not self._warned:
            print(f"warning: reward failed ({why}); scored 0 and counted in reward_errors",
                  flush=True)
            self._warned = True
        return None if why is not None else r

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        rc = self.run_cfg
        found = self._prepare_out_dir()
        print(f"building engines: {self.client_config.model_name} ({self.client_config.comm_protocol}, "
              f"{self.client_config.dtype}); out_dir {os.path.abspath(self.out_dir)}", flush=True)
        with create_rl_client(self.client_config) as client:
            start = self._resume(client, found)
            logger = MetricsLogger(self.out_dir, total_steps=rc.steps, start_step=start,
                                   progress=rc.progress, tensorboard=rc.tensorboard)
            history, saved = [], found[0] if found else None
            try:
                for step in range(start, rc.steps):
                    phase = lambda text, step=step: logger.phase(step, text)
                    metrics = self.step(client, step, phase)
                    last = step + 1 == rc.steps
                    if self.evaluator is not None and ((step + 1) % rc.eval_every == 0 or last):
                        phase("evaluating")
                        metrics.update(self.evaluator.evaluate(client, step))
                    logger.log(step, metrics)
                    history.append(metrics)
                    if last or (rc.checkpoint_every and (step + 1) % rc.checkpoint_every == 0):
                        phase("saving a checkpoint")
                        saved = checkpoint.save(client, self.out_dir, step + 1,
                                                {"next_step": step + 1, **self._data_settings()},
                                                rc.keep_checkpoints)
            finally:
                logger.close()
        print(f"metrics: {os.path.abspath(logger.path)}", flush=True)
        model = self._report_model(saved)
        return {"start_step": start, "steps": len(history), "metrics_path": logger.path,
                "history": history, "checkpoint": saved, "model": model}

    def _prepare_out_dir(self) -> tuple[str, dict] | None:
        """Decide, before any engine is built, whether this run resumes (the checkpoint to load),
        starts fresh, or refuses because ``out_dir`` holds a run it would overwrite."""
        rc = self.run_cfg
        if rc.overwrite:
            checkpoint.clear_run(self.out_dir)
            return None
        found = checkpoint.latest(self.out_dir) if rc.resume else None
        if found is None and checkpoint.has_run(self.out_dir):
            why = "it has no complete checkpoint to resume from" if rc.resume else "run.resume=false"
            raise ValueError(f"{os.path.abspath(self.out_dir)} already holds a run (metrics.jsonl / "
                             f"checkpoints) and {why}: pass a new run.out_dir=..., or "
                             "run.overwrite=true to delete that run first")
        if found is not None:
            self._check_same_data(found[1])
        return found

    def _check_same_data(self, state: dict) -> None:
        """``ValueError`` when the run to resume drew its prompts or seeds otherwise."""
        now = self._data_settings()
        changed = {k: (state[k], v) for k, v in now.items() if k in state and state[k] != v}
        if "sampling_seeds" not in state:  # a run from before per-prompt seeds
            changed["sampling_seeds"] = ("one per step", now["sampling_seeds"])
        if changed:
            raise ValueError(f"{os.path.abspath(self.out_dir)} holds a run with other data settings ("
                             + ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in sorted(changed.items()))
                             + "): resume with the same settings, or pass a new run.out_dir=...")

    def _data_settings(self) -> dict:
        """The settings that decide which prompts a step draws and how it samples them: a
        resumed run must have the same, or its steps after the checkpoint are another run's."""
        rc = self.run_cfg
        return {"seed": rc.seed, "task": self.cfg.task.name, "train_split": self.cfg.task.train_split,
                "prompts_per_step": rc.prompts_per_step, "group_size": rc.group_size,
                "sampling_seeds": "per_prompt"}

    def _resume(self, client, found) -> int:
        if found is None:
            return 0
        path, state = found
        client.load(os.path.join(path, "engine"))
        client.sync_weights()
        print(f"resumed from {path} at step {state['next_step']}", flush=True)
        return int(state["next_step"])

    def _report_model(self, saved: str | None) -> str | None:
        """Print (last line of the run) where the trained model is; return the HF export path."""
        if saved is None:
            print("model: none saved (run.steps=0)", flush=True)
            return None
        hf = os.path.join(os.path.abspath(saved), "engine", "hf")
        if self.client_config.train.export_hf and os.path.isdir(hf):
            print(f"model: {hf} (Hugging Face format: AutoModelForCausalLM.from_pretrained)", flush=True)
            return hf
        print(f"model: {os.path.abspath(saved)}/engine (DeepSpeed checkpoint; client.train.export_hf=false)",
              flush=True)
        return None

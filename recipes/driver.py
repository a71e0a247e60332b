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
and TensorBoard logs first). A resume with another seed, task, train split, prompts per step,
group size, model, dtype, ZeRO stage, lr or ``client.train.optim`` is refused (its later steps
would be another run's); other settings (loss, sampling, lengths, eval, steps, checkpointing)
apply from the resumed step on.

Rewards and advantages, per step: each completion is decoded without special tokens and scored
by the task's ``reward`` with ``task.reward`` options; a truncated one (``finish_reason ==
"length"``: no EOS within ``run.max_new_tokens``) is scored like any other, as verl and TRL do
by default, and counted in ``truncated_frac``. A completion the reward cannot judge (it raised,
or returned NaN/inf) is never scored: it trains with advantage 0, stays out of its group's mean
and std, is counted in ``reward_errors`` and named in a warning; a step where no completion can
be judged stops the run (the reward itself is broken). ``reward_mean`` / ``reward_std`` /
``reward_max`` are over the judged completions. Advantages: :func:`group_advantages`
(population std; groups with equal rewards get exactly 0).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import textwrap
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
from .tasks.common import describe, judge


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool, eps: float,
                     judged: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std plus
    ``eps`` if ``scale``.

    The std is the population std (``unbiased=False``, divisor G), polynya's choice: verl's
    ``compute_grpo_outcome_advantage`` and TRL's ``GRPOTrainer`` divide by the sample std
    (divisor G - 1), so these are ``sqrt(G / (G - 1))`` times theirs (1.069x at G = 8, 1.41x at
    G = 2) up to ``eps``; only the effective step size differs. The statistics are computed in
    float64. A group whose judged rewards are all equal (std 0), or that has fewer than two
    judged rewards, gets advantage exactly 0 (a float32 mean of eight 0.3s is not 0.3: divided
    by ``0 + eps`` that rounding became +-0.03 for every sample). Unlike verl, a group of one
    sample is not given its raw reward as advantage (verl's mean 0, std 1): it gets 0.

    Args:
        rewards: ``[num_prompts * group_size]``, laid out group by group; entries where
            ``judged`` is False are ignored (any value, NaN included).
        group_size: samples per group (G), >= 1.
        scale: divide by the group's std (``run.scale_advantages``).
        eps: added to the std, finite and >= 0 (``run.advantage_eps``; verl's 1e-6 by default,
            TRL's is 1e-4).
        judged: ``[num_prompts * group_size]`` bool, False for a completion the reward could not
            judge: it is left out of its group's mean and std and gets advantage 0 (TRL 1.16
            does the same for a completion every reward function returned None for).
    Returns:
        ``[num_prompts * group_size]`` float32 advantages.
    Raises:
        ValueError: a shape that does not split into groups, a judged reward that is not
            finite, or a bad ``eps``.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if rewards.dim() != 1 or rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if judged is None:
        judged = torch.ones(rewards.shape, dtype=torch.bool)
    if judged.shape != rewards.shape or judged.dtype != torch.bool:
        raise ValueError(f"judged must be a bool tensor of shape {tuple(rewards.shape)}")
    r = rewards.detach().to(torch.float64).view(-1, group_size)
    ok = judged.to(r.device).view(-1, group_size)
    bad = ok & ~torch.isfinite(r)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise ValueError(f"reward {r.flatten()[i].item()} of sample {i} (group {i // group_size}) "
                         "is not finite: mark it unjudged instead")
    r = torch.where(ok, r, 0.0)
    n = ok.sum(dim=1, keepdim=True)
    mean = r.sum(dim=1, keepdim=True) / n.clamp(min=1)
    dev = torch.where(ok, r - mean, 0.0)
    high = torch.where(ok, r, -math.inf).amax(dim=1, keepdim=True)
    low = torch.where(ok, r, math.inf).amin(dim=1, keepdim=True)
    flat = (n < 2) | (high == low)
    if scale:
        std = ((dev * dev).sum(dim=1, keepdim=True) / n.clamp(min=1)).sqrt()
        flat |= std + eps == 0  # eps 0 and deviations that underflow when squared
        dev = dev / torch.where(flat, 1.0, std + eps)
    return torch.where(flat, 0.0, dev).to(torch.float32).flatten()


def check_run(rc) -> None:
    """``ValueError`` for run-section values the loop cannot use."""
    for name in ("steps", "checkpoint_every", "eval_every", "eval_examples"):
        if isinstance(rc[name], bool) or not isinstance(rc[name], int) or rc[name] < 0:
            raise ValueError(f"run.{name} must be an integer >= 0, got {rc[name]!r}")
    for name in ("prompts_per_step", "group_size", "max_new_tokens", "keep_checkpoints"):
        if isinstance(rc[name], bool) or not isinstance(rc[name], int) or rc[name] < 1:
            raise ValueError(f"run.{name} must be an integer >= 1, got {rc[name]!r}")
    if rc.group_size < 2:
        raise ValueError("run.group_size must be >= 2: a GRPO advantage is a reward minus its "
                         "group's mean, so a group of one sample has advantage 0 and trains nothing")
    eps = rc.advantage_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"run.advantage_eps must be a finite number >= 0, got {eps!r}")


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

        responses, rewards_t, judged_t, failures, truncated = self._score(step, idx, groups)
        adv = group_advantages(rewards_t, rc.group_size, scale=rc.scale_advantages, eps=rc.advantage_eps,
                               judged=judged_t)
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
        scored = rewards_t[judged_t]  # never empty: _report_unjudged raised
        return dict(reward_mean=scored.mean().item(), reward_std=scored.std(unbiased=False).item(),
                    reward_max=scored.max().item(),
                    response_len=sum(map(len, responses)) / len(responses),
                    truncated_frac=truncated / len(responses), reward_errors=len(failures),
                    **{k: v for k, v in train.items() if isinstance(v, (int, float))},
                    **times, step_s=sum(times.values()))

    def _score(self, step: int, idx: list[int], groups) -> tuple:
        """``(responses, rewards [N] float64, judged [N] bool, failures, truncated count)`` of the
        step's sample groups (``groups[k]`` samples train example ``idx[k]``); unjudged rewards
        are NaN."""
        responses, rewards, judged, failures, truncated = [], [], [], [], 0
        for i, samples in zip(idx, groups, strict=True):
            if len(samples) != self.run_cfg.group_size:
                raise RuntimeError(f"generate returned {len(samples)} samples for train example {i}, "
                                   f"not run.group_size={self.run_cfg.group_size}")
            for s in samples:
                reward, why = self._reward(s.token_ids, self.examples[i])
                if why is not None:
                    failures.append((i, why))
                rewards.append(reward)
                judged.append(why is None)
                responses.append(s.token_ids)
                truncated += s.finish_reason == "length"
        self._report_unjudged(step, failures, len(rewards))
        return (responses, torch.tensor(rewards, dtype=torch.float64), torch.tensor(judged, dtype=torch.bool),
                failures, truncated)

    def _reward(self, token_ids: list[int], example: Example) -> tuple[float, str | None]:
        """``(reward, None)``, or ``(nan, why)`` when the task's reward raised or was not finite:
        one odd completion must never end a run, nor be scored as if it had been judged."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        r, why = judge(self.task, text, example, self.reward_kwargs)
        return (r, None) if why is None else (math.nan, why)

    def _report_unjudged(self, step: int, failures: list[tuple[int, str]], total: int) -> None:
        """Warn, naming the first prompt, when some completions of the step could not be judged
        (they train with advantage 0 and stay out of their groups' statistics); ``RuntimeError``
        when none could: the reward function itself is broken."""
        if not failures:
            return
        i, why = failures[0]
        first = (f"train example {i} ({describe(self.examples[i])}): "
                 + textwrap.shorten(why, 300, placeholder=" ..."))
        if len(failures) == total:
            raise RuntimeError(f"step {step}: the {self.cfg.task.name} reward could judge none of the "
                               f"{total} completions; first: {first}")
        print(f"warning: step {step}: {len(failures)} of {total} completions could not be judged "
              f"(advantage 0, left out of their groups' mean and std; counted in reward_errors); "
              f"first: {first}", flush=True)

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
        """``ValueError`` when the run to resume drew its prompts or seeds otherwise, or trained
        another model or with other optimizer settings (the engine's load would restore the
        checkpoint's AdamW settings and LR schedule over the new ones: refused here before
        any engine is built)."""
        now = json.loads(json.dumps(self._data_settings()))  # as driver.json holds them
        changed = {k: (state[k], v) for k, v in now.items() if k in state and state[k] != v}
        if "sampling_seeds" not in state:  # a run from before per-prompt seeds
            changed["sampling_seeds"] = ("one per step", now["sampling_seeds"])
        if changed:
            raise ValueError(f"{os.path.abspath(self.out_dir)} holds a run with other settings ("
                             + ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in sorted(changed.items()))
                             + "): resume with the same settings, or pass a new run.out_dir=...")

    def _data_settings(self) -> dict:
        """The settings that decide which prompts a step draws, how it samples them, and which
        model and optimizer settings train on them: a resumed run must have the same, or its
        steps after the checkpoint are another run's (checked by ``_check_same_data``)."""
        rc, client = self.run_cfg, self.client_config
        return {"seed": rc.seed, "task": self.cfg.task.name, "train_split": self.cfg.task.train_split,
                "prompts_per_step": rc.prompts_per_step, "group_size": rc.group_size,
                "sampling_seeds": "per_prompt", "model": client.model_name, "dtype": client.train.dtype,
                "zero_stage": client.train.zero_stage, "lr": client.train.lr,
                "optim": dataclasses.asdict(client.train.optim)}

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

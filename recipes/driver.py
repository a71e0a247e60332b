"""The built-in GRPO driver: prompts -> generate n -> rewards -> group advantages ->
(reference log-probs) -> train -> sync, through the public client only.

    driver = GRPODriver(cfg)          # cfg: a composed RecipeConfig (see schema.py)
    summary = driver.run()            # per-step metrics in <out_dir>/metrics.jsonl

Each step is a pure function of (seed, step) for its data, so a run resumed from a checkpoint
continues exactly where the killed one stopped.
"""
from __future__ import annotations

import os
import random
import time

import torch

from .. import RolloutBatch, SamplingParams, create_rl_client
from ..models import load_tokenizer
from . import checkpoint
from .metrics import MetricsLogger
from .schema import to_client_config
from .tasks import Example, get_task


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool, eps: float) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's std if ``scale``.

    Args: rewards ``[num_prompts * group_size]`` laid out group by group. Returns the same shape.
    """
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv.flatten()


class GRPODriver:
    def __init__(self, cfg):
        self.cfg = cfg
        self.run_cfg = cfg.run
        self.task = get_task(cfg.task.name)
        self.client_config = to_client_config(cfg.client)
        self.tokenizer = load_tokenizer(self.client_config.model_name)
        self.examples, self.prompt_ids = self._load_prompts()
        self.out_dir = cfg.run.out_dir
        self.reward_kwargs = dict(cfg.task.reward)
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

    def _load_prompts(self) -> tuple[list[Example], list[list[int]]]:
        examples = self.task.load(self.cfg.task.train_split, self.cfg.task.source)
        kept, ids = [], []
        for ex in examples:
            toks = self._encode(ex.prompt)
            if 0 < len(toks) <= self.cfg.task.max_prompt_tokens:
                kept.append(ex)
                ids.append(toks)
        if not kept:
            raise ValueError(f"no {self.cfg.task.name} prompt fits task.max_prompt_tokens="
                             f"{self.cfg.task.max_prompt_tokens}")
        return kept, ids

    def _pick(self, step: int) -> list[int]:
        rng = random.Random(self.run_cfg.seed * 1_000_003 + step)
        n = min(self.run_cfg.prompts_per_step, len(self.examples))
        return rng.sample(range(len(self.examples)), n)

    # ------------------------------------------------------------------ one step
    def step(self, client, step: int) -> dict:
        rc, times = self.run_cfg, {}
        idx = self._pick(step)
        prompts = [self.prompt_ids[i] for i in idx]
        params = SamplingParams(n=rc.group_size, temperature=self.client_config.train.temperature, top_p=rc.top_p,
                                top_k=rc.top_k, max_tokens=rc.max_new_tokens, seed=rc.seed + step)
        t = time.perf_counter()
        groups = client.generate(prompts, params)
        times["generate_s"] = time.perf_counter() - t

        responses, rewards, truncated = [], [], 0
        for i, samples in zip(idx, groups):
            for s in samples:
                text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                rewards.append(float(self.task.reward(text, self.examples[i], **self.reward_kwargs)))
                responses.append(s.token_ids)
                truncated += s.finish_reason == "length"
        rewards_t = torch.tensor(rewards)
        adv = group_advantages(rewards_t, rc.group_size, scale=rc.scale_advantages, eps=rc.advantage_eps)
        batch = RolloutBatch([p for p in prompts for _ in range(rc.group_size)], responses,
                             group_ids=[g for g in range(len(prompts)) for _ in range(rc.group_size)],
                             advantages=adv)
        if self.kl:
            t = time.perf_counter()
            batch.ref_logprobs = client.compute_logprobs(batch, model="reference").logprobs
            times["logprobs_s"] = time.perf_counter() - t

        t = time.perf_counter()
        train = client.forward_backward(batch)
        train.update(client.step())
        times["train_s"] = time.perf_counter() - t
        t = time.perf_counter()
        client.sync_weights()
        times["sync_s"] = time.perf_counter() - t
        return dict(reward_mean=rewards_t.mean().item(), reward_std=rewards_t.std(unbiased=False).item(),
                    reward_max=rewards_t.max().item(),
                    response_len=sum(map(len, responses)) / len(responses),
                    truncated_frac=truncated / len(responses),
                    **{k: v for k, v in train.items() if isinstance(v, (int, float))},
                    **times, step_s=sum(times.values()))

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        rc = self.run_cfg
        os.makedirs(self.out_dir, exist_ok=True)
        with create_rl_client(self.client_config) as client:
            start = self._resume(client)
            logger = MetricsLogger(self.out_dir, total_steps=rc.steps, start_step=start,
                                   progress=rc.progress, tensorboard=rc.tensorboard)
            history = []
            try:
                for step in range(start, rc.steps):
                    metrics = self.step(client, step)
                    logger.log(step, metrics)
                    history.append(metrics)
                    if rc.checkpoint_every and (step + 1) % rc.checkpoint_every == 0:
                        checkpoint.save(client, self.out_dir, step + 1,
                                        {"next_step": step + 1, "seed": rc.seed}, rc.keep_checkpoints)
            finally:
                logger.close()
        print(f"metrics: {os.path.abspath(logger.path)}", flush=True)
        return {"start_step": start, "steps": len(history), "metrics_path": logger.path, "history": history}

    def _resume(self, client) -> int:
        found = checkpoint.latest(self.out_dir) if self.run_cfg.resume else None
        if found is None:
            return 0
        path, state = found
        client.load(os.path.join(path, "engine"))
        client.sync_weights()
        print(f"resumed from {path} at step {state['next_step']}", flush=True)
        return int(state["next_step"])

"""Held-out evaluation of a recipe run: mean reward and pass@1 on the task's test split.

``Evaluator(task, examples, prompt_ids, ...)`` is built once; ``evaluate(client, step)`` samples
one completion per held-out prompt (greedy by default, else at the training temperature with a
seed fixed per step) and scores it with the task's reward::

    {"eval_reward_mean": 0.41, "eval_pass_at_1": 0.375, "eval_examples": 64, "eval_s": 3.2}

``eval_pass_at_1`` is the fraction of completions whose reward reaches the task's full score:
its ``score`` reward option where it has one (gsm8k's ``task.reward.score``), else 1.0 (a fully
correct answer under every shipped task's reward).
"""
from __future__ import annotations

import time
from types import ModuleType

from .. import SamplingParams
from .seeds import per_prompt
from .tasks import Example
from .tasks.common import judge


class Evaluator:
    def __init__(self, task: ModuleType, examples: list[Example], prompt_ids: list[list[int]], *,
                 tokenizer, reward_kwargs: dict, max_new_tokens: int, greedy: bool,
                 temperature: float, seed: int):
        if not examples:
            raise ValueError(f"{task.NAME}: no held-out example to evaluate on")
        self.task, self.examples, self.prompt_ids = task, examples, prompt_ids
        self.tokenizer, self.reward_kwargs = tokenizer, reward_kwargs
        self.max_new_tokens, self.greedy = max_new_tokens, greedy
        self.temperature, self.seed = temperature, seed
        self.full_score = float(reward_kwargs.get("score", 1.0))

    def evaluate(self, client, step: int) -> dict[str, float]:
        t = time.perf_counter()
        params = per_prompt(SamplingParams(n=1, temperature=0.0 if self.greedy else self.temperature,
                                           max_tokens=self.max_new_tokens),
                            "eval", self.seed, step, len(self.prompt_ids))
        outs = client.generate(self.prompt_ids, params)
        rewards, errors = [], 0
        for ex, (sample,) in zip(self.examples, outs):
            text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            r, why = judge(self.task, text, ex, self.reward_kwargs)  # never raises: scored 0
            rewards.append(r)
            errors += why is not None
        return {"eval_reward_mean": sum(rewards) / len(rewards),
                "eval_pass_at_1": sum(r >= self.full_score for r in rewards) / len(rewards),
                "eval_examples": len(rewards), "eval_reward_errors": errors,
                "eval_s": time.perf_counter() - t}

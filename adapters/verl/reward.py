"""verl ``custom_reward_function`` scoring with polynya's task rewards (``polynya.recipes.tasks``).

``polynya-recipe framework=verl`` writes each example's task name as ``data_source``, its answer
as ``reward_model.ground_truth`` and its prompt / meta in ``extra_info``, and points verl's
``reward.custom_reward_function`` here, with ``task.reward`` as ``reward_kwargs``: verl's run is
scored by the same function as polynya's own driver. A completion the reward cannot judge (it
raises, or returns NaN / inf) stops verl's run with a ``ValueError`` naming the prompt: verl has
no way to leave one completion out of its group's statistics (polynya's own driver does), and a
NaN would turn the whole group's advantages into NaN.
"""
from __future__ import annotations

import json

from polynya.recipes.tasks import Example, get_task
from polynya.recipes.tasks.common import describe, judge


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **reward_kwargs) -> float:
    """``get_task(data_source).reward(solution_str, example, **reward_kwargs)``; ``ValueError``
    naming the prompt when it cannot judge the completion (module docstring)."""
    info = extra_info or {}
    example = Example(info.get("prompt", ""), str(ground_truth), json.loads(info.get("meta", "{}")))
    reward, why = judge(get_task(data_source), solution_str, example, reward_kwargs)
    if why is not None:
        raise ValueError(f"the {data_source} reward could not judge a completion of "
                         f"{describe(example)}: {why}; verl cannot leave it out of its group "
                         "(framework=builtin does)")
    return reward

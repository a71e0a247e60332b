"""verl ``custom_reward_function`` scoring with polynya's task rewards (``polynya.recipes.tasks``).

``polynya-recipe framework=verl`` writes each example's task name as ``data_source``, its answer
as ``reward_model.ground_truth`` and its prompt / meta in ``extra_info``, and points verl's
``reward.custom_reward_function`` here, with ``task.reward`` as ``reward_kwargs``: verl's run is
scored by the same function as polynya's own driver.
"""
from __future__ import annotations

import json

from polynya.recipes.tasks import Example, get_task


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **reward_kwargs) -> float:
    """``get_task(data_source).reward(solution_str, example, **reward_kwargs)``."""
    info = extra_info or {}
    example = Example(info.get("prompt", ""), str(ground_truth), json.loads(info.get("meta", "{}")))
    return float(get_task(data_source).reward(solution_str, example, **reward_kwargs))

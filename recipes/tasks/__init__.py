"""RL tasks: prompts with reference answers, and reward functions that score completions.

Every task module (``gsm8k``, ``txt2sql``, ``longqa``, ``toy``) has ``NAME``,
``load(split, source=None) -> list[Example]`` and ``reward(completion, example) -> float``::

    from polynya.recipes.tasks import get_task
    task = get_task("gsm8k")
    examples = task.load("train")              # bundled sample; or an HF id / local path
    score = task.reward(completion_text, examples[0])

``source=None`` loads the small sample bundled under ``recipes/data`` (made by
``python -m polynya.recipes.tasks.make_data``).
"""
from __future__ import annotations

from types import ModuleType

from . import gsm8k, longqa, toy, txt2sql
from .common import Example

TASKS: dict[str, ModuleType] = {m.NAME: m for m in (gsm8k, txt2sql, longqa, toy)}


def get_task(name: str) -> ModuleType:
    """The task module called ``name`` (``gsm8k``, ``txt2sql``, ``longqa`` or ``toy``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]


__all__ = ["Example", "TASKS", "get_task", "gsm8k", "longqa", "toy", "txt2sql"]

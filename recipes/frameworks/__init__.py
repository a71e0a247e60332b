"""Where a recipe runs: one module per framework, each with ``run(cfg) -> None``.

``framework=builtin`` is polynya's own GRPO driver (``polynya.recipes.driver``); adapters add
``framework=<name>`` by shipping ``recipes/frameworks/<name>.py`` and
``recipes/conf/framework/<name>.yaml``. The same task, data, reward and ``run`` settings go to
every framework; a framework module translates them and nothing more.
"""
from __future__ import annotations

import importlib

from omegaconf import DictConfig


def run(cfg: DictConfig) -> None:
    """Run the composed recipe ``cfg`` on ``cfg.framework`` (ValueError for an unknown one)."""
    name = cfg.framework
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        known = sorted(p.stem for p in _folder().glob("*.py") if not p.stem.startswith("_"))
        raise ValueError(f"framework={name!r} is unknown; choose one of {known}") from None
    module.run(cfg)


BUILTIN_ONLY = ("eval_every", "overwrite")  # run settings only the built-in driver implements


def reject_builtin_only(cfg: DictConfig, framework: str) -> None:
    """``ValueError`` when a ``run`` setting that ``framework`` does not translate is set."""
    for key in BUILTIN_ONLY:
        if cfg.run[key]:
            raise ValueError(f"framework={framework} does not translate run.{key}; it is a setting of "
                             "framework=builtin")


def reject_fixed_eps(cfg: DictConfig, framework: str, fixed: float) -> None:
    """``ValueError`` when ``run.advantage_eps`` is changed for a framework whose GRPO adds a
    fixed constant to the group std (verl 0.9.1: 1e-6, TRL: 1e-4): it would be ignored."""
    from ..schema import RunSection

    if cfg.run.advantage_eps != RunSection.advantage_eps:
        raise ValueError(f"framework={framework} does not translate run.advantage_eps="
                         f"{cfg.run.advantage_eps}: {framework}'s GRPO adds a fixed {fixed:g} to the "
                         "group std; leave it at its default or use framework=builtin")


def reject_loss_clamps(loss_config, framework: str, its_own: str) -> None:
    """``ValueError`` when ``loss_config`` (``client.train.loss_config``) sets ``log_ratio_clip``
    / ``kl_clip`` for a framework whose loss does not take them (``its_own``: what it does)."""
    for name in ("log_ratio_clip", "kl_clip"):
        if getattr(loss_config, name) is not None:
            raise ValueError(f"framework={framework} does not translate client.train.loss_config."
                             f"{name}={getattr(loss_config, name)}: {its_own}; leave it unset or "
                             "use framework=builtin")


def _folder():
    from pathlib import Path

    return Path(__file__).parent

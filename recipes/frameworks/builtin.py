"""``framework=builtin``: polynya's own GRPO driver (``polynya.recipes.driver``)."""
from __future__ import annotations

from omegaconf import DictConfig


def run(cfg: DictConfig) -> None:
    from ..driver import GRPODriver

    GRPODriver(cfg).run()

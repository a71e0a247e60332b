"""Entry point of verl's ``verl.plugins`` group: registers polynya's backends when verl loads.

``import verl`` imports this module (``pyproject.toml``: ``[project.entry-points."verl.plugins"]``).
verl logs a plugin that fails to import at DEBUG level only, so a broken install would silently
leave ``strategy=deepspeed`` / ``rollout.name=polynya`` unknown; this module therefore never
raises: it catches the failure and issues a ``PolynyaPluginWarning`` naming the error and the fix.
Set ``VERL_USE_EXTERNAL_PLUGINS=none`` to keep verl from loading it at all.
"""
from __future__ import annotations

import traceback
import warnings


class PolynyaPluginWarning(RuntimeWarning):
    """polynya's verl backends could not be registered."""


def _load() -> None:
    try:
        from .registry import register_all

        register_all()
    except Exception as exc:  # noqa: BLE001 - verl would swallow it at DEBUG; say it loudly instead
        where = traceback.extract_tb(exc.__traceback__)[-1]
        warnings.warn(
            f"polynya's verl plugin failed to load ({type(exc).__name__}: {exc}; at "
            f"{where.filename}:{where.lineno}). verl runs without polynya's backends: "
            "strategy=deepspeed, rollout.name=polynya and checkpoint_engine.backend=polynya are "
            "unavailable. Fix: reinstall with `pip install 'polynya[verl]'` (stock verl 0.9.1) and "
            "check that `python -c 'import polynya.adapters.verl.registry'` works.",
            PolynyaPluginWarning, stacklevel=2)


_load()

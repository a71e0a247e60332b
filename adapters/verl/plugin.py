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


_deferred = False  # verl loaded its plugins while one of our modules was half-imported


def _mid_import(exc: ImportError) -> bool:
    """The failure is one of this package's own modules still executing its top (the user
    imported e.g. ``polynya.adapters.verl.engine`` before verl: that import ran verl's plugin
    loop, which came back here before the module had defined its classes)."""
    return (exc.name or "").startswith(__package__ + ".") and "partially initialized" in str(exc)


def _load() -> None:
    global _deferred
    try:
        from .registry import register_all

        register_all()
    except ImportError as exc:
        if _mid_import(exc):
            _deferred = True  # completed by complete_deferred() at the end of that module
        else:
            _warn(exc)
    except Exception as exc:  # noqa: BLE001 - verl would swallow it at DEBUG; say it loudly instead
        _warn(exc)


def complete_deferred() -> None:
    """Register now if ``_load`` had to wait for a half-imported module of this package (each
    module that imports verl at its top calls this, through the package, when it is done)."""
    global _deferred
    if _deferred:
        _deferred = False
        _load()


def _warn(exc: Exception) -> None:
    where = traceback.extract_tb(exc.__traceback__)[-1]
    warnings.warn(
        f"polynya's verl plugin failed to load ({type(exc).__name__}: {exc}; at "
        f"{where.filename}:{where.lineno}). verl runs without polynya's backends: "
        "strategy=deepspeed, rollout.name=polynya and checkpoint_engine.backend=polynya are "
        "unavailable. Fix: reinstall with `pip install 'polynya[verl]'` (stock verl 0.9.1) and "
        "check that `python -c 'import polynya.adapters.verl.registry'` works.",
        PolynyaPluginWarning, stacklevel=3)

_load()

"""Recipe checkpoints: ``<out_dir>/checkpoints/step_000010/{engine/, driver.json, MANIFEST.json}``.

``MANIFEST.json`` (``polynya.files``: size and sha256 of every file) is written last, so a
directory without it (a run killed mid-save) is never taken for a checkpoint. ``latest`` finds
the newest complete one and verifies every file before the run resumes from it: a corrupted,
truncated or mismatched checkpoint is a ``CheckpointError`` naming the file (with
``fallback=True`` it is skipped, with a warning, for the newest one that verifies).
``save`` keeps the last K.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings

from polynya.files import MANIFEST, CheckpointError, verify_manifest, write_manifest

STATE = "driver.json"


def checkpoint_dir(out_dir: str, step: int) -> str:
    return os.path.join(out_dir, "checkpoints", f"step_{step:06d}")


def complete(out_dir: str) -> list[str]:
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    dirs = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    return [os.path.join(root, d) for d in dirs if os.path.isfile(os.path.join(root, d, MANIFEST))]


METRICS = "metrics.jsonl"
_RUN_FILES = (METRICS, "checkpoints", "tensorboard")  # what a run leaves in out_dir


def has_run(out_dir: str) -> bool:
    """Whether ``out_dir`` holds (part of) a previous run: metrics or checkpoints."""
    return any(os.path.exists(os.path.join(out_dir, name)) for name in _RUN_FILES[:2])


def clear_run(out_dir: str) -> None:
    """Delete a previous run's metrics, checkpoints and TensorBoard logs (``run.overwrite``)."""
    for name in _RUN_FILES:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def latest(out_dir: str, *, fallback: bool = False) -> tuple[str, dict] | None:
    """(directory, driver state) of the newest complete checkpoint, verified, or None.

    ``CheckpointError`` naming the bad file when it does not verify, unless ``fallback``:
    then older ones are tried (each skipped one is warned about)."""
    for path in reversed(complete(out_dir)):
        try:
            verify_manifest(path)
            with open(os.path.join(path, STATE)) as f:
                return path, json.load(f)
        except (CheckpointError, ValueError) as exc:
            if not fallback:
                raise CheckpointError(f"cannot resume from {path}: {exc}") from None
            warnings.warn(f"skipping checkpoint {path}: {exc}", stacklevel=2)
    return None


def save(client, out_dir: str, step: int, state: dict, keep: int) -> str:
    """Save the engines' state (``client.save``) and then the driver's; prune old ones."""
    path = checkpoint_dir(out_dir, step)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    client.save(os.path.join(path, "engine"))
    tmp = os.path.join(path, STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, os.path.join(path, STATE))
    write_manifest(path)
    for old in complete(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path

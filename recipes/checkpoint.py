"""Recipe checkpoints: ``<out_dir>/checkpoints/step_000010/{engine/, driver.json}``.

``driver.json`` is written last, so a directory without it (a run killed mid-save) is never
taken for a checkpoint. ``latest`` finds the newest complete one; ``prune`` keeps the last K.
"""
from __future__ import annotations

import json
import os
import shutil

STATE = "driver.json"


def checkpoint_dir(out_dir: str, step: int) -> str:
    return os.path.join(out_dir, "checkpoints", f"step_{step:06d}")


def complete(out_dir: str) -> list[str]:
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    dirs = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    return [os.path.join(root, d) for d in dirs if os.path.isfile(os.path.join(root, d, STATE))]


def latest(out_dir: str) -> tuple[str, dict] | None:
    """(directory, driver state) of the newest complete checkpoint, or None."""
    found = complete(out_dir)
    if not found:
        return None
    with open(os.path.join(found[-1], STATE)) as f:
        return found[-1], json.load(f)


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
    for old in complete(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path

"""File manifests: a sha256 per file of a checkpoint directory, verified before anything loads.

::

    clear_checkpoint(path)   # before a save into a directory that holds one: its files removed
    write_manifest(path)     # after every file is written: path/MANIFEST.json (atomic rename)
    verify_manifest(path)    # before loading: CheckpointError naming the first bad file

The manifest lists every regular file under ``path`` (relative names, sizes, sha256) except
itself. ``verify_manifest`` refuses a directory without one, a listed file that is missing,
truncated or whose bytes changed, and a file that is not listed (a mix of two checkpoints) —
so a corrupted checkpoint is an error that names the file, never a silent resume from wrong
bytes. It guards against corruption, not against someone who can rewrite the manifest too
(loading never unpickles arbitrary objects either: see ``safe_torch_load``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

MANIFEST = "MANIFEST.json"
CHECKPOINT_TAG = "polynya"  # TrainingEngine.save's DeepSpeed tag folder: <checkpoint>/polynya/*.pt
_READ = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (missing, corrupted, truncated or mismatched)."""


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def _files(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:  # os.walk does not enter them: their files would go unlisted, unchecked
            if os.path.islink(os.path.join(dirpath, d)):
                rel = os.path.relpath(os.path.join(dirpath, d), root)
                raise CheckpointError(f"{os.path.join(root, rel)!r} is a symbolic link to a directory: a "
                                      "checkpoint holds regular directories only (copy it with its files)")
        dirnames.sort()
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out.append(rel.replace(os.sep, "/"))
    return out


def clear_checkpoint(root: str) -> None:
    """Remove the checkpoint a directory holds before another is saved into it: the manifest
    first (an interrupted save then never passes ``verify_manifest``), then every file it
    listed, then the folders that held them once empty. Anything it did not list is left alone
    (not ours); a directory without a readable manifest is left as it is. Without this, a file
    of the old checkpoint that the new one does not write (an ``hf/`` export, another world
    size's partitions) would be listed as the new one's."""
    path = os.path.join(root, MANIFEST)
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    os.remove(path)
    real = os.path.realpath(root)
    folders = set()
    for rel in files if isinstance(files, dict) else ():
        full = os.path.realpath(os.path.join(root, rel))
        if os.path.commonpath([real, full]) == real and full != real and os.path.isfile(full):
            os.remove(full)
            folders.update(p for p in Path(full).parents if os.path.commonpath([real, p]) == real)
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):  # deepest first
        if str(folder) != real and not os.listdir(folder):
            os.rmdir(folder)


def write_manifest(root: str) -> dict:
    """Hash every file under ``root`` and write ``root/MANIFEST.json`` (last, atomically)."""
    entries = {rel: {"bytes": os.path.getsize(os.path.join(root, rel)),
                     "sha256": file_sha256(os.path.join(root, rel))} for rel in _files(root)}
    manifest = {"format": 1, "files": entries}
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MANIFEST))
    return manifest


def verify_manifest(root: str) -> dict:
    """``CheckpointError`` (naming the file and what is wrong) unless every file under ``root``
    is listed in its manifest with the same size and sha256; returns the manifest."""
    if not os.path.isdir(root):
        raise CheckpointError(f"no checkpoint directory {root!r}")
    path = os.path.join(root, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except FileNotFoundError:
        raise CheckpointError(f"{root!r} has no {MANIFEST}: not a complete polynya checkpoint "
                              "(interrupted save, or written by another tool)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path!r} is unreadable ({exc}): the checkpoint is corrupted") from None
    present = set(_files(root))
    for rel in sorted(present - set(files)):
        raise CheckpointError(f"{os.path.join(root, rel)!r} is not in the checkpoint's manifest "
                              "(files of another checkpoint mixed in?)")
    for rel, want in sorted(files.items()):
        full = os.path.join(root, rel)
        if rel not in present:
            raise CheckpointError(f"{full!r} is missing from the checkpoint")
        size = os.path.getsize(full)
        if size != want.get("bytes"):
            raise CheckpointError(f"{full!r} has {size} bytes, the manifest says {want.get('bytes')} "
                                  "(truncated or replaced)")
        if file_sha256(full) != want.get("sha256"):
            raise CheckpointError(f"{full!r} is corrupted: its sha256 differs from the manifest's")
    return manifest


_LOAD_LOCK = threading.Lock()


@contextlib.contextmanager
def safe_torch_load(allowed: Iterable[type] = ()) -> Iterator[None]:
    """Inside the block every ``torch.load`` in this process unpickles tensors, containers and
    the ``allowed`` types only (``weights_only=True`` even where a library passes False, as
    DeepSpeed's checkpoint engine does); anything else raises instead of running code."""
    import torch.serialization as ser

    with _LOAD_LOCK:
        old = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
        os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
        try:
            with ser.safe_globals(list(allowed)):
                yield
        finally:
            if old is None:
                os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
            else:
                os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old

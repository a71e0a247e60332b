"""Receiver side of a weight sync: stage every bucket, verify, then apply in one go.

::

    staged = StagedUpdate(manifest)
    for i, flat in enumerate(received):   # broadcast buffers, or IPC / shared-memory views
        staged.put(i, flat)               # wrong dtype / size (truncated) -> SyncError
    version = apply_update(engine, staged)  # all buckets there + checksum == trainer's, else SyncError

Nothing touches the engine until every bucket is present and the checksum of the staged bytes
equals the trainer's ``weight_checksum()``; a rejected sync leaves the engine serving its
previous weights and version. Staged buckets are the received buffers themselves (no copy);
``apply_update`` copies them straight into the engine's parameters.

What depends only on the manifest's layout (offsets checked, digest block tables, checksum line
prefixes) is prepared once per layout (``polynya.sync.layout.bucket_layout``); the engine gets
the buckets as ``polynya.weights.FlatBuckets``, which the native sampler copies with one
``_foreach_copy_`` through a plan it also keeps per layout.
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterator

import torch

from ..distributed import checksum_named_tensors
from ..weights import FlatBuckets
from .manifest import SyncError, SyncManifest


class StagedUpdate:
    """Buckets of one sync, collected and checked before they are applied."""

    def __init__(self, manifest: SyncManifest):
        self.manifest = manifest
        self.flats: list[torch.Tensor | None] = [None] * len(manifest.buckets)
        self._layout = None

    def layout(self):
        """The manifest's ``BucketLayout`` (cached per layout; ``SyncError`` if malformed)."""
        if self._layout is None:
            from .layout import bucket_layout

            self._layout = bucket_layout(self.manifest)
        return self._layout

    def put(self, index: int, flat: torch.Tensor) -> None:
        """Stage bucket ``index`` (a 1-D tensor in the manifest's dtype and size)."""
        if not 0 <= index < len(self.flats):
            raise SyncError(
                f"bucket index {index} outside the manifest's {len(self.flats)} buckets"
            )
        spec = self.manifest.buckets[index]
        if not isinstance(flat, torch.Tensor):
            raise SyncError(f"bucket {index} is a {type(flat).__name__}, not a tensor")
        if flat.dtype != self.manifest.torch_dtype:
            raise SyncError(
                f"bucket {index} has dtype {flat.dtype}, manifest says {self.manifest.dtype}"
            )
        if flat.dim() != 1 or flat.numel() != spec.numel:
            raise SyncError(
                f"bucket {index} has {flat.numel()} elements (shape {tuple(flat.shape)}); "
                f"the manifest expects {spec.numel} (truncated or wrong bucket)"
            )
        self.flats[index] = flat

    def missing(self) -> list[int]:
        return [i for i, f in enumerate(self.flats) if f is None]

    def named_views(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec, flat in zip(self.manifest.buckets, self.flats):
            yield from spec.views(flat)

    def checksum(self) -> str:
        """The trainer-checksum digest of the staged bytes (``polynya.sync.digest``): read in
        place from the buckets, one device -> host transfer."""
        return self.layout().checksum(self.flats)

    def verify(self) -> None:
        """``SyncError`` unless every bucket is staged and the checksum matches the trainer's."""
        missing = self.missing()
        if missing:
            raise SyncError(
                f"partial sync of version {self.manifest.version}: buckets {missing[:8]} "
                f"of {len(self.flats)} never arrived"
            )
        got = self.checksum()
        if got != self.manifest.checksum:
            raise SyncError(
                f"checksum mismatch for version {self.manifest.version}: staged weights "
                f"hash to {got}, the trainer's weight_checksum() is {self.manifest.checksum}"
            )

    def pieces(self) -> FlatBuckets:
        """What ``load_weights`` takes: the buckets with their layout (``FlatBuckets``; iterated,
        ``(names, flat)`` buckets, or ``(name, view)`` pairs for span buckets)."""
        return FlatBuckets(self.manifest.buckets, list(self.flats), key=self.layout())


def current_version(engine) -> int:
    """The weight version an engine serves (``SamplingEngine.stats()`` or ``weight_version``)."""
    if hasattr(engine, "weight_version"):
        return int(engine.weight_version)
    stats = getattr(engine, "stats", None)
    return int(stats().get("weight_version", 0)) if stats is not None else 0


_APPLY_LOCK = threading.Lock()


def apply_update(engine, staged: StagedUpdate, *, verify: bool = True) -> int:
    """Verify ``staged`` and load it into ``engine`` (sampler or log-prob engine).

    Returns the new version. ``SyncError`` (engine untouched) when the sync is partial, its
    checksum differs from the trainer's, or its version is not newer than the one served.
    """
    version = staged.manifest.version
    with _APPLY_LOCK:
        served = current_version(engine)
        if version <= served:
            raise SyncError(f"stale sync: version {version} is not newer than the served {served}")
        if verify:
            staged.verify()
        elif staged.missing():
            raise SyncError(f"partial sync: buckets {staged.missing()[:8]} never arrived")
        pieces = staged.pieces()
        try:
            if _takes_version(engine):
                engine.load_weights(pieces, version=version)
            else:
                engine.load_weights(pieces)
                engine.weight_version = version
        except ValueError as exc:  # names / shapes that do not fit the engine: nothing was copied
            raise SyncError(f"sync of version {version} does not fit the engine: {exc}") from exc
        return version


def _takes_version(engine) -> bool:
    fn = engine.load_weights
    fn = getattr(fn, "__func__", fn)
    try:
        return _TAKES_VERSION[fn]
    except (KeyError, TypeError):
        import inspect

        takes = "version" in inspect.signature(engine.load_weights).parameters
        try:
            _TAKES_VERSION[fn] = takes
        except TypeError:  # not weak-referenceable / hashable: not cached
            pass
        return takes


_TAKES_VERSION: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_checksum(engine) -> str:
    """``checksum_named_tensors`` of an engine's live weights (sampler, log-prob or trainer)."""
    if hasattr(engine, "weight_checksum"):
        return engine.weight_checksum()
    model = engine_model(engine)
    return checksum_named_tensors(model.named_parameters())


def engine_model(engine) -> torch.nn.Module:
    """The ``nn.Module`` behind a sampling engine (native backend) or a log-prob engine."""
    for path in (("backend", "runner", "model"), ("runner", "model"), ("module",)):
        obj = engine
        for attr in path:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.Module):
            return obj
    raise TypeError(f"cannot find the model of a {type(engine).__name__}")

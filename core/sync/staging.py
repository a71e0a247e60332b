"""Receiver side of a weight sync: stage every bucket, verify, then apply in one go.

::

    staged = StagedUpdate(manifest)
    for i, flat in enumerate(received):   # broadcast buffers, or IPC / shared-memory views
        staged.put(i, flat)               # wrong dtype / size (truncated) -> SyncError
    version = apply_update(engine, staged)  # all buckets there + checksum == trainer's, else SyncError

Nothing touches the engine until every bucket is present and the engine's ``load_weights`` has
checked the staged bytes against the trainer's ``weight_checksum()`` (always: there is no
unverified path); a rejected sync leaves the engine serving its previous weights and version. Staged buckets are the received buffers themselves (no copy);
``apply_update`` copies them straight into the engine's parameters.

What depends only on the manifest's layout (offsets checked, digest block tables, checksum line
prefixes) is prepared once per layout (``polynya.sync.layout.bucket_layout``); the engine gets
the buckets as ``polynya.weights.FlatBuckets``, which the native sampler checks and copies
through a ``polynya.verified_copy.VerifiedBucketCopy`` it also keeps per layout (one read to
digest and check every bucket, then one copy launch per bucket; nothing written on a mismatch).
"""

from __future__ import annotations

import threading
from typing import Iterator

import torch

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

    def clear(self) -> None:
        """Drop every staged bucket (their buffers may be freed)."""
        self.flats = [None] * len(self.flats)

    def missing(self) -> list[int]:
        return [i for i, f in enumerate(self.flats) if f is None]

    def named_views(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec, flat in zip(self.manifest.buckets, self.flats):
            yield from spec.views(flat)

    def checksum(self) -> str:
        """``polynya.checksum`` of the staged bytes, read in place from the buckets."""
        return self.layout().checksum(self.flats)

    def pieces(self) -> FlatBuckets:
        """What ``load_weights`` takes: the buckets with their layout (``FlatBuckets``; iterated,
        ``(names, flat)`` buckets, or ``(name, view)`` pairs for span buckets)."""
        return FlatBuckets(self.manifest.buckets, list(self.flats), key=self.layout())


_APPLY_LOCK = threading.Lock()


def apply_update(engine, staged: StagedUpdate) -> int:
    """Load ``staged`` into ``engine`` (a sampler or log-prob engine) under its version.

    The engine's ``load_weights(pieces, version=, checksum=)`` checks every piece (names,
    shapes, finite values, the trainer's checksum) before it copies anything and moves its
    version only once the weights are in. Returns the new version. ``SyncError`` (engine
    untouched, still serving its previous version) when the sync is partial, stale, its
    checksum differs from the trainer's, or it does not fit the engine.
    """
    manifest = staged.manifest
    version = manifest.version
    with _APPLY_LOCK:
        served = engine.weight_version
        if version <= served:
            raise SyncError(f"stale sync: version {version} is not newer than the served {served}")
        missing = staged.missing()
        if missing:
            raise SyncError(f"partial sync of version {version}: buckets {missing[:8]} of "
                            f"{len(staged.flats)} never arrived")
        try:
            return engine.load_weights(staged.pieces(), version=version, checksum=manifest.checksum)
        except ValueError as exc:  # checked before any copy: nothing was loaded
            raise SyncError(f"sync of version {version} rejected: {exc}") from exc

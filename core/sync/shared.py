"""Colocated weight sync: flat buckets shared between processes, one handle per bucket.

On CUDA a bucket is shared by CUDA-IPC (``torch.multiprocessing.reductions.reduce_tensor``)
and the receiver maps it. With a span manifest (ZeRO-1/2: every weight is a view of one flat
buffer) the bucket *is* the trainer's weight storage: nothing is packed or copied before the
receiver writes the bytes into its own parameters. With a packed manifest (ZeRO-0/3) the buckets
are ``export_weights``' flat copies. On CPU each bucket is copied once into a POSIX
shared-memory segment (``multiprocessing.shared_memory``) that the receiver maps by name.

::

    # trainer process                          # sampler process (same GPU / host)
    out = SharedExport.from_trainer(trainer, manifest, bucket_bytes)
    handles = out.handles          ------->    staged = open_shared(manifest, handles)
                                               apply_update(sampler, staged)
    out.release()                  <-------    (after every receiver is done)

Handles are small picklable objects (Ray, multiprocessing queues, pipes). While the sync is in
flight the export holds no copy (CUDA spans) or one flat copy (packed, or CPU); the receiver
holds none (it reads the mapped buckets).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch

from .manifest import SyncError, SyncManifest
from .staging import StagedUpdate

_CREATED: set[str] = set()  # segments this process created (it alone unlinks them)


class _Attached:
    """A mapped segment created by another process. Mapped directly (``shm_open`` + ``mmap``)
    so that this process's resource tracker never learns of it: it must not unlink the
    trainer's segment when this process exits."""

    def __init__(self, name: str):
        import mmap

        import _posixshmem

        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


def _attach(name: str):
    if name in _CREATED:  # our own segment (same process): reuse the normal path
        return shared_memory.SharedMemory(name=name)
    return _Attached(name)


@dataclass(frozen=True)
class BucketHandle:
    """A picklable reference to one shared flat bucket."""

    kind: str  # "cuda_ipc" | "shm"
    payload: Any  # cuda_ipc: (rebuild_fn, args); shm: segment name
    numel: int
    dtype: str


def _share(flat: torch.Tensor) -> tuple[BucketHandle, Any]:
    """(handle, keep-alive) for one bucket."""
    if flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return BucketHandle("cuda_ipc", reduce_tensor(flat), flat.numel(), str(flat.dtype)), flat
    nbytes = flat.numel() * flat.element_size()
    seg = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    _CREATED.add(seg.name)
    view = torch.frombuffer(seg.buf, dtype=flat.dtype, count=flat.numel())
    view.copy_(flat)
    del view
    return BucketHandle("shm", seg.name, flat.numel(), str(flat.dtype)), seg


class SharedExport:
    """The trainer's shared buckets of one sync; ``release()`` frees them."""

    def __init__(self, manifest: SyncManifest):
        self.manifest = manifest
        self.handles: list[BucketHandle] = []
        self._keep: list[Any] = []

    @classmethod
    def from_trainer(
        cls, trainer, manifest: SyncManifest, bucket_bytes: int, *, share: bool = True
    ) -> "SharedExport":
        """Export ``trainer``'s weights bucket by bucket (every trainer rank calls it under
        ZeRO-3; ``share=False`` consumes the buckets without sharing them)."""
        out = cls(manifest)
        if manifest.buckets and manifest.buckets[0].offsets is not None:
            return out._share_spans(trainer, share)
        for i, (names, flat) in enumerate(trainer.export_weights(bucket_bytes)):
            if i >= len(manifest.buckets) or tuple(names) != manifest.buckets[i].names:
                out.release()
                raise SyncError(
                    f"export bucket {i} does not match the manifest (weights changed "
                    "between build_manifest and export?)"
                )
            if share:
                handle, keep = _share(flat)
                out.handles.append(handle)
                out._keep.append(keep)
        if share and len(out.handles) != len(manifest.buckets):
            out.release()
            raise SyncError(
                f"export produced {len(out.handles)} buckets, manifest has {len(manifest.buckets)}"
            )
        if share and out.handles and out.handles[0].kind == "cuda_ipc":
            torch.cuda.synchronize()  # receivers read on their own streams
        return out

    def _share_spans(self, trainer, share: bool) -> "SharedExport":
        """Span manifests: share the trainer's flat storages themselves (no packing on CUDA)."""
        from ..spans import export_spans

        spans = export_spans(trainer.module, self.manifest.buckets)
        if spans is None:
            raise SyncError(
                "the trainer's flat weight storages changed since the manifest was built"
            )
        for span in spans if share else ():
            handle, keep = _share(span)
            self.handles.append(handle)
            self._keep.append(keep)
        if self.handles and self.handles[0].kind == "cuda_ipc":
            torch.cuda.synchronize()  # receivers read on their own streams
        return self

    def release(self) -> None:
        for keep in self._keep:
            if isinstance(keep, shared_memory.SharedMemory):
                keep.close()
                _CREATED.discard(keep.name)
                try:
                    keep.unlink()
                except FileNotFoundError:
                    pass
        self._keep.clear()
        self.handles = []

    def __del__(self) -> None:
        self.release()


class OpenedBuckets:
    """Mapped buckets on the receiver side; ``close()`` unmaps them (after ``apply_update``)."""

    def __init__(self, staged: StagedUpdate, segments: list):
        self.staged = staged
        self._segments = segments

    def close(self) -> None:
        self.staged.clear()
        for seg in self._segments:
            try:
                seg.close()
            except BufferError:  # a view is still alive somewhere; the OS frees it at exit
                pass
        self._segments.clear()


def open_shared(
    manifest: SyncManifest, handles: list[BucketHandle], device: torch.device | str | None = None
) -> OpenedBuckets:
    """Map the trainer's buckets and stage them (``SyncError`` on a bad handle list)."""
    staged = StagedUpdate(manifest)
    if len(handles) > len(manifest.buckets):
        raise SyncError(f"{len(handles)} handles for a manifest of {len(manifest.buckets)} buckets")
    segments: list = []
    opened = OpenedBuckets(staged, segments)
    try:
        for i, h in enumerate(handles):
            if not isinstance(h, BucketHandle):
                raise SyncError(f"handle {i} is a {type(h).__name__}, not a BucketHandle")
            if h.kind == "cuda_ipc":
                fn, args = h.payload
                flat = fn(*args)
            elif h.kind == "shm":
                seg = _attach(h.payload)
                segments.append(seg)
                elem = torch.empty((), dtype=manifest.torch_dtype).element_size()
                count = min(h.numel, seg.size // elem)
                flat = torch.frombuffer(seg.buf, dtype=manifest.torch_dtype, count=count)
            else:
                raise SyncError(f"unknown bucket handle kind {h.kind!r}")
            if device is not None and flat.device != torch.device(device):
                flat = flat.to(device)
            staged.put(i, flat)
    except FileNotFoundError as exc:
        opened.close()
        raise SyncError(f"shared bucket vanished before it was read: {exc}") from exc
    except Exception:
        opened.close()
        raise
    return opened
